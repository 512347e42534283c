# An image that grades a submission mounted at /submission:
#
#   docker build -t grader .
#   docker run --rm -v "$PWD/assignments:/submission:ro" -v "$PWD/out:/results" grader
#
# CPU by default. For NVIDIA GPUs (NCCL), take torch's CUDA wheels, which carry
# their own CUDA runtime (the host needs the driver and the container toolkit):
#
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t grader:cuda .
#   docker run --rm --gpus all -v ... grader:cuda
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
RUN pip install -e . \
    && useradd --create-home --uid 10001 grader \
    && mkdir /results /submission \
    && chown grader /results

USER 10001
ENTRYPOINT ["grader"]
CMD ["run", "--submission", "/submission", "--results", "/results/results.json"]
