"""What runs inside each rank of a torchrun job: the worker, its pytest plugin and its guards."""
