# The course on NVIDIA's NGC PyTorch container, whose Python already holds a CUDA build of torch
# and Transformer Engine: both are used as they are (docs/gpu.md says which tag and why).
#
#   docker build -t moe-tutorial .
#   docker run --gpus all --ipc=host -p 8888:8888 \
#     -v "$PWD/work:/workspace/moe-tutorial/work" moe-tutorial   # JupyterLab; your work/ kept
#   docker run --gpus all --ipc=host moe-tutorial make course       # the course, headless
#
# The tag: the first NGC PyTorch release that can hold TE 2.20 (released 2026-10-05), by the
# releases' one-TE-minor-a-month cadence (26.06 holds TE 2.16.0); docs/gpu.md gives the sources
# and what is and is not confirmed. The guard below reads the TE the image really holds.
ARG NGC_TAG=26.10-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}
ARG NGC_TAG

# The Transformer Engine release the course was checked with, read from the package metadata
# (importing TE needs a GPU, which `docker build` has not).
RUN python3 -c "import importlib.metadata as m, sys; v = m.version('transformer_engine'); \
sys.exit(None if v.startswith('2.20.') else f'nvcr.io/nvidia/pytorch:${NGC_TAG} holds \
Transformer Engine {v}; the course was checked with 2.20.x: build with --build-arg NGC_TAG=<a \
tag whose release notes list TE 2.20> (docs/gpu.md)')"

WORKDIR /workspace/moe-tutorial
COPY . .
# The course: .venv sees the container's packages (--system-site-packages) and is held at its
# torch, so neither torch nor TE is installed again; a stamp lets every later command start
# without the network.
RUN python3 -m tools.bootstrap --extras course,hf
EXPOSE 8888
CMD ["python3", "-m", "tools.bootstrap", "--extras", "course,hf", "--", "-m", "moe_tutorial", "lab", "--", "--ip=0.0.0.0", "--port=8888", "--no-browser"]
