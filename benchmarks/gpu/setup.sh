# Source on a lent GPU machine (device tool): installs the carried wheels (.whl: ortools and
# its missing needs) into /tmp/site and makes jaxmem + torch_ref importable from the checkout.
# The GPU image brings its own jax/jaxlib (CUDA), flax, optax, torch (CUDA), pytest, hypothesis.
# Fetch the wheels beforehand on a machine with PyPI (git-ignored folder, carried to the GPU):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl ortools==9.15.6755 immutabledict "protobuf>=6.33.1,<6.34"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # several test workers share one GPU
export PYTHONUNBUFFERED=1
python3 - <<'PY'
import importlib, jax
print("jax", jax.__version__, jax.devices())
for m in ("jaxlib", "flax", "optax", "torch", "ortools", "numpy", "scipy", "hypothesis", "rich"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:  # noqa: BLE001
        print(m, "MISSING", e)
import torch; print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
