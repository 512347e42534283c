#!/usr/bin/env bash
# Gradescope runs this once, when the autograder image is built, with this
# repository unpacked in /autograder/source.
set -eu
cd /autograder/source
pip3 install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
pip3 install -e .
