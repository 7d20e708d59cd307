#!/usr/bin/env bash
# The benchmark peers, each in its own directory and never a dependency of the package:
#   llama-server  llama.cpp's OpenAI-compatible server, built twice from the tree vendored in the
#                 llama-cpp-python sdist: a portable AVX2 build (build/), with llama-quantize beside it
#                 (throughput.py's --gguf-type Q4_K_M and the like), and a build for the CPU it is built on
#                 (build-native-noamx/, -DGGML_NATIVE=ON), as pagedserve's own kernels are (-march=native),
#                 less AMX (AVX-512, VNNI and BF16 stay): a native build with AMX died at model load on the
#                 machines tried, on an AMX-capable Xeon VM in ggml's AMX kernel (SIGILL or SIGSEGV at a
#                 tilezero), and before on AMD EPYC machines. The benchmarks report each build that runs.
#                 llama-server-portable or llama-server-native builds one of them only.
#   guidellm      a load generator for OpenAI-compatible servers, in its own virtualenv
#
#   bash benchmarks/setup_peers.sh [llama-server] [guidellm]     # both when none is named
#
# Everything goes under $PAGEDSERVE_PEERS_DIR (default: benchmarks/.peers); a peer already built is kept.
# Each llama.cpp build takes about 8 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")"
PEERS="${PAGEDSERVE_PEERS_DIR:-$PWD/.peers}"
LLAMA_CPP_PYTHON_VERSION=0.3.36
GUIDELLM_VERSION=0.8.1
PYTHON="${PYTHON:-python3}"
mkdir -p "$PEERS"

llama_cpp_source() {
  if [[ -f "$PEERS/llama.cpp/CMakeLists.txt" ]]; then return; fi
  local src="$PEERS/src"
  mkdir -p "$src"
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$src"
  tar -xzf "$src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$src"
  rm -rf "$PEERS/llama.cpp"
  mv "$src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" "$PEERS/llama.cpp"
  # The tree has no git history: this names its source in the benchmarks' output (peers.py).
  echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist" > "$PEERS/llama.cpp/SOURCE"
  rm -rf "$src"
}

# build_llama_cpp DIR TARGETS CMAKE_FLAGS...: llama.cpp's TARGETS built into $PEERS/llama.cpp/DIR.
build_llama_cpp() {
  local dir="$PEERS/llama.cpp/$1" targets=($2) missing=()
  shift 2
  for t in "${targets[@]}"; do [[ -x "$dir/bin/$t" ]] || missing+=("$t"); done
  if [[ ${#missing[@]} -gt 0 ]]; then
    llama_cpp_source
    [[ -f "$dir/build.ninja" ]] || cmake -S "$PEERS/llama.cpp" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=ON "$@"
    cmake --build "$dir" --target "${missing[@]}" -j "$(nproc)"
  fi
  echo "llama-server ($(basename "$dir")): $dir/bin/llama-server"
}

build_portable() {
  build_llama_cpp build "llama-server llama-quantize" -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
}

# Under GGML_NATIVE, ggml compiles with -march=native alone and ignores its GGML_AMX_* options: -march=native
# turns AMX on wherever the CPU has it, and so the AMX kernel that crashed. GCC's explicit -mno-amx-* win over
# -march=native whatever their order (all three: GCC 12's -mno-amx-tile leaves AMX-INT8 on). The directory is
# named for it, so that a native build with AMX from an earlier setup is never reused.
build_native() {
  local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  build_llama_cpp build-native-noamx "llama-server" -DGGML_NATIVE=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx"
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
    llama-server) build_portable; build_native ;;
    llama-server-portable) build_portable ;;
    llama-server-native) build_native ;;
    guidellm) install_guidellm ;;
    *) echo "unknown peer: $t (llama-server, llama-server-portable, llama-server-native, guidellm)" >&2; exit 2 ;;
  esac
done
