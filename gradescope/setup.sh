#!/usr/bin/env bash
# Gradescope runs this once, when it builds the autograder image, with the zip
# that `grader gradescope OUT.zip` wrote unpacked in $AUTOGRADER_ROOT/source.
# AUTOGRADER_ROOT (default /autograder) lets the project's tests lay it out elsewhere.
set -eu
root="${AUTOGRADER_ROOT:-/autograder}"
cd "$root/source"
# The CPU build of torch first: a plain `pip install .` would pull a multi-GB CUDA build.
# TORCH_INDEX names another index (a mirror); where the index cannot be reached in one try,
# pip's default one is used (on Linux a CUDA build: larger, but it grades), with no retries
# lost on the first (they cost minutes each).
torch_index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
python3 -m pip install --retries 0 --timeout 30 --index-url "$torch_index" torch==2.13.0 \
    || python3 -m pip install torch==2.13.0
# Then the grader itself, not editable: the package is copied into site-packages and
# finds this folder's tests/graded/ through run_autograder's --config.
python3 -m pip install .
# Where namespaces are refused (Gradescope's containers), the ranks run as an unprivileged
# uid, walled in by Landlock: the course (the graded tests, their configuration) must also
# be unreadable to it, which the grader checks before it grades.
chmod -R o-rwx "$root/source"
