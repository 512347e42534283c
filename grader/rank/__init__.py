"""What runs inside each rank's sandbox: the worker that runs the calls the grader sends,
the ``broker`` process-group backend and its link to the trusted broker, and the frames that
point a student at their line. Nothing here is trusted, and nothing here makes a verdict."""
