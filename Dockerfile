# An image that grades a submission mounted at /submission (the grader needs no
# network: the ranks talk over loopback, which --network none keeps):
#
#   docker build -t grader .
#   docker run --rm --network none -v "$PWD/assignments:/submission:ro" -v "$PWD/out:/results" grader
#
# CPU by default. For NVIDIA GPUs (NCCL), take torch's CUDA wheels, which carry
# their own CUDA runtime (the host needs the driver and the container toolkit):
#
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t grader:cuda .
#   docker run --rm --gpus all --ipc=host -v ... grader:cuda
#
# NCCL moves data between the GPUs of one machine through shared memory
# (/dev/shm), and Docker gives a container only 64 MB of it: NCCL then fails or
# hangs. Share the host's (--ipc=host) or give it more (--shm-size=1g or larger).
#
# The grader runs as root in the container, and each rank as a uid of its own run's (never
# root, never one anything else uses), with a seccomp filter (no socket of its own) and a
# Landlock allow-list of paths: Docker's default profile refuses namespaces, so the ranks
# run at the `uid` sandbox level (it needs a kernel with Landlock, Linux 5.13+; the course
# is also made unreadable to others below). Where namespaces are allowed (e.g.
# --security-opt seccomp=unconfined --cap-add SYS_ADMIN), bubblewrap gives `namespaces`.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# bubblewrap for the namespaces level; libseccomp2 (the filter's compiler) is in the base.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap libseccomp2 \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /opt/grader
COPY pyproject.toml README.md ./
COPY grader ./grader
COPY reference ./reference
COPY assignments ./assignments
COPY tests/graded ./tests/graded
# Not editable: the package goes to site-packages; GRADER_CONFIG says where the
# course (graded tests, reference, stubs) is.
ENV GRADER_CONFIG=/opt/grader/tests/graded/grading.yaml
# The course (reference, graded tests, configuration) unreadable to the ranks' uids; the
# ranks import a copy of the grader that each run makes.
RUN pip install . \
    && mkdir /results /submission \
    && chmod -R o-rwx /opt/grader

ENTRYPOINT ["grader"]
CMD ["run", "--submission", "/submission", "--results", "/results/results.json"]
