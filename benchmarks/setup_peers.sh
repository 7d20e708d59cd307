#!/usr/bin/env bash
# The benchmark peers, each in its own directory and never a dependency of the package:
#   llama-server  llama.cpp's OpenAI-compatible server, built from the tree vendored in the
#                 llama-cpp-python sdist (a portable AVX2 build: a -DGGML_NATIVE=ON build has crashed
#                 in its AMX path on AMD EPYC machines), and llama-quantize beside it (throughput.py's
#                 --gguf-type Q4_K_M and the like)
#   guidellm      a load generator for OpenAI-compatible servers, in its own virtualenv
#
#   bash benchmarks/setup_peers.sh [llama-server] [guidellm]     # both when none is named
#
# Everything goes under $PAGEDSERVE_PEERS_DIR (default: benchmarks/.peers); a peer already built is kept.
# The llama.cpp build takes about 8 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")"
PEERS="${PAGEDSERVE_PEERS_DIR:-$PWD/.peers}"
LLAMA_CPP_PYTHON_VERSION=0.3.36
GUIDELLM_VERSION=0.8.1
PYTHON="${PYTHON:-python3}"
mkdir -p "$PEERS"

build_llama_server() {
  local bin="$PEERS/llama.cpp/build/bin/llama-server"
  if [[ -x "$bin" && -x "$PEERS/llama.cpp/build/bin/llama-quantize" ]]; then echo "llama-server: $bin"; return; fi
  if [[ -x "$bin" ]]; then  # built before llama-quantize came with it
    cmake --build "$PEERS/llama.cpp/build" --target llama-quantize -j "$(nproc)"
    echo "llama-server: $bin"
    return
  fi
  local src="$PEERS/src"
  mkdir -p "$src"
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$src"
  tar -xzf "$src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$src"
  rm -rf "$PEERS/llama.cpp"
  mv "$src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" "$PEERS/llama.cpp"
  rm -rf "$src"
  cmake -S "$PEERS/llama.cpp" -B "$PEERS/llama.cpp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
  cmake --build "$PEERS/llama.cpp/build" --target llama-server llama-quantize -j "$(nproc)"
  echo "llama-server: $bin"
}

install_guidellm() {
  local venv="$PEERS/guidellm"
  if [[ -x "$venv/bin/guidellm" ]]; then echo "guidellm: $venv/bin/guidellm"; return; fi
  "$PYTHON" -m venv "$venv"
  # torch 2.13.0 first: the CPU build from local disk (guidellm pulls torch; any other version pulls GBs).
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q "guidellm==$GUIDELLM_VERSION"
  echo "guidellm: $venv/bin/guidellm"
}

targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=(llama-server guidellm)
for t in "${targets[@]}"; do
  case "$t" in
    llama-server) build_llama_server ;;
    guidellm) install_guidellm ;;
    *) echo "unknown peer: $t (llama-server, guidellm)" >&2; exit 2 ;;
  esac
done
