#!/usr/bin/env bash
# llama.cpp's own binaries, run from a cache folder without installing anything into the system.
#
#   tools/llama_cpp.sh fetch                 download, check and unpack the pinned packages; print the cache folder
#   tools/llama_cpp.sh TOOL [ARGS...]        run a llama.cpp tool (llama-completion, llama-perplexity,
#                                            llama-tokenize, llama-cli, llama-server, ...), fetching first if needed
#
# The binaries are Debian's (`llama.cpp-tools`, `llama.cpp-tools-extra`, from unstable), built for a newer C library
# than most machines have. So the packages they need (their C and C++ runtimes too) are downloaded with apt-get under
# a private configuration (its own sources list, state and cache: nothing of the system's apt is read or changed),
# each checked against the SHA-256 pinned below, unpacked with `dpkg -x` into the cache, and every tool is started
# through the unpacked C library's own loader (`ld-linux-x86-64.so.2 --library-path ...`) with the CPU backend named by
# GGML_BACKEND_PATH. Needs apt-get and dpkg (Debian or Ubuntu) and access to Debian's archive.
#
#   LLAMA_CPP_CACHE    cache folder (default: ~/.cache/automodel-ckpt/llama.cpp-0.7.0)
#   LLAMA_CPP_MIRROR   Debian mirror (default: http://deb.debian.org/debian)
#   LLAMA_CPP_BACKEND  ggml CPU variant (default: from the CPU's flags: skylakex, haswell or sse42)
#
# Exit status 3 with one line `llama_cpp: ...` when the packages cannot be had (no apt-get, no network, the pinned
# versions gone from the archive); the opt-in tests then skip with that line.
set -euo pipefail

VERSION="0.7.0"
# package=version sha256 (Debian unstable, 2026-11)
PINNED=(
  "llama.cpp-tools=1:0.7.0+dfsg-2 3007c170f116891974bd37d5ba802f094c7d020412f2100cc71582fc8530895c"
  "llama.cpp-tools-extra=1:0.7.0+dfsg-2 4598b97ab2d2222dd484aad51946f96e6c77c448b2732565cebe753be782022a"
  "libllama0=1:0.7.0+dfsg-2 7d49cde5582ccdc8c454b379ba627eea8c95813b6a9c70628653101f629204d6"
  "libggml0=0.27.0-1 f621153d6615a8dd1ac4b14e110cbafca34cc66f551367c5f6326f71fb141b0d"
  "libc6=2.43-7 5c71715c51103beb4fbba9fe9f8dff604af6610dfa71c70bff342f54a7860803"
  "libstdc++6=16.2.0-4 cef6654bba1daece0bc0dbe0e3f69fa5a26eb6ba139f3536e6f4806bd787f3e7"
  "libgcc-s1=16.2.0-4 d251ea642c3795e8723ac2b9eeebe511467ca04590ba70f3d555a7616787d7e3"
  "libgomp1=16.2.0-4 11cb09fd79c2de0acbdc23b0eb350445c563b16a36d879b355dfd45a5d2d6d3e"
  "libssl3t64=3.6.5-1 0a0ec84fe860c5c93c74d53cbb071aea0793327a3761b483080e9d7b73c21b37"
  "libzstd1=1.5.7+dfsg-4 93e7930e4c25b918f1dd980cc1c6d4487654a248f5fa71eacb976ed7bbe954bd"
  "zlib1g=1:1.3.dfsg+really1.3.2-4 8506ce550a81ac14b047608e0df121037d9cbb10c3cc28446f68cf8c1d9d31ce"
)
CACHE="${LLAMA_CPP_CACHE:-$HOME/.cache/automodel-ckpt/llama.cpp-$VERSION}"
MIRROR="${LLAMA_CPP_MIRROR:-http://deb.debian.org/debian}"
ROOT="$CACHE/root"
LIB="$ROOT/usr/lib/x86_64-linux-gnu"

fail() { echo "llama_cpp: $*" >&2; exit 3; }

fetch() {
  [ -f "$CACHE/.complete" ] && return 0
  command -v apt-get >/dev/null && command -v dpkg >/dev/null || fail "needs apt-get and dpkg (Debian or Ubuntu)"
  [ "$(uname -m)" = x86_64 ] || fail "the pinned packages are for x86_64, this machine is $(uname -m)"
  local apt="$CACHE/apt" debs="$CACHE/debs"
  rm -rf "$apt" "$ROOT"
  mkdir -p "$apt/state/lists/partial" "$apt/cache/archives/partial" "$apt/parts" "$debs" "$ROOT"
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  local signed=""
  [ -f "$keyring" ] && signed="signed-by=$keyring"
  echo "deb [${signed:-trusted=yes}] $MIRROR sid main" > "$apt/sources.list"
  : > "$apt/state/status"
  cat > "$apt/apt.conf" <<EOF
Dir::Etc::SourceList "$apt/sources.list";
Dir::Etc::SourceParts "$apt/parts";
Dir::Etc::Parts "$apt/parts";
Dir::Etc::Preferences "$apt/parts/none";
Dir::Etc::PreferencesParts "$apt/parts";
Dir::State "$apt/state";
Dir::State::status "$apt/state/status";
Dir::Cache "$apt/cache";
APT::Architecture "amd64";
APT::Architectures "amd64";
APT::Sandbox::User "root";
Acquire::Languages "none";
// a machine whose clock runs ahead of the archive's signature still gets the lists: every package file is pinned
// by its checksum below, whatever the lists say
Acquire::Check-Valid-Until "false";
EOF
  export APT_CONFIG="$apt/apt.conf"
  apt-get -qq update >"$CACHE/fetch.log" 2>&1 || fail "cannot read Debian's package lists from $MIRROR (see $CACHE/fetch.log)"
  local entry spec sum file
  for entry in "${PINNED[@]}"; do
    spec="${entry% *}"
    (cd "$debs" && apt-get -qq download "$spec" >>"$CACHE/fetch.log" 2>&1) \
      || fail "cannot download $spec (gone from the archive? see $CACHE/fetch.log)"
  done
  for entry in "${PINNED[@]}"; do
    spec="${entry% *}" sum="${entry#* }"
    file=$(ls "$debs/${spec%%=*}_"*.deb 2>/dev/null | head -1)
    [ -n "$file" ] || fail "no package file for $spec"
    [ "$(sha256sum "$file" | cut -d' ' -f1)" = "$sum" ] || fail "checksum mismatch for $(basename "$file")"
    dpkg -x "$file" "$ROOT"
  done
  touch "$CACHE/.complete"
}

backend() {
  if [ -n "${LLAMA_CPP_BACKEND:-}" ]; then echo "$LLAMA_CPP_BACKEND"
  elif grep -qw avx512f /proc/cpuinfo; then echo skylakex
  elif grep -qw avx2 /proc/cpuinfo; then echo haswell
  else echo sse42
  fi
}

[ $# -ge 1 ] || { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
if [ "$1" = fetch ]; then
  fetch
  echo "$CACHE"
  exit 0
fi
tool="$1"
shift
fetch
[ -x "$ROOT/usr/bin/$tool" ] || fail "no tool '$tool' in the packages (see $ROOT/usr/bin)"
export GGML_BACKEND_PATH="$LIB/ggml/backends0/libggml-cpu-$(backend).so"
exec "$LIB/ld-linux-x86-64.so.2" --library-path "$LIB:$LIB/llama:$LIB/ggml/backends0" "$ROOT/usr/bin/$tool" "$@"
