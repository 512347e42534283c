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
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

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
RUN pip install . \
    && useradd --create-home --uid 10001 grader \
    && mkdir /results /submission \
    && chown grader /results

USER 10001
ENTRYPOINT ["grader"]
CMD ["run", "--submission", "/submission", "--results", "/results/results.json"]
