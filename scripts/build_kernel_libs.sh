#!/usr/bin/env bash
# Build DeepSeek's kernel libraries (FlashMLA, DeepGEMM, DeepSelect) from their public sources for the
# cuda backend's adapters (src/deepinfer_kernels/cuda/adapters.py). None of their code is committed here:
# `pack` makes an archive of the pinned commits from local git mirrors, `build` compiles it on the GPU
# machine (no network there), `install` puts the built packages on PYTHONPATH in a later call.
#
#   bash scripts/build_kernel_libs.sh pack  [ARCHIVE]        # CPU side; default .gpu/kernel_src.tar.xz
#   bash scripts/build_kernel_libs.sh build [LIB ...]        # GPU side; LIB: flash_mla deep_gemm deep_select
#   bash scripts/build_kernel_libs.sh install [ARCHIVE ...]  # GPU side, later calls; default .gpu/klib_*.tar.xz
#   bash scripts/build_kernel_libs.sh check                  # GPU side: import each library, print versions
#   bash scripts/build_kernel_libs.sh unpack                 # either side: unpack only (the CPU tests compare
#                                                            # our quantisers with the libraries' pure-torch ones)
#
# pack reads bare git mirrors (the `fetch` tool's /work/.mirror/<owner>+<name>/repo by default; override
# with FLASH_MLA_GIT, DEEP_GEMM_GIT, CUTLASS_GIT, FMT_GIT) and keeps only what the builds read: each
# library's tree at its pinned commit, and of its submodules only the include trees (cutlass include/ and
# tools/util/include, fmt include/). DeepSelect has no mirror here: pass its source tree as
# DEEP_SELECT_SRC=/path (with csrc/3rdparty/cutlass filled) and it is packed too, else it is left out.
#
# build unpacks to build/kernel_libs/src (an ignored path, so a warm machine keeps it and a second call
# resumes an interrupted ninja build), builds a wheel per library with
# `pip wheel --no-build-isolation --no-deps` (SM90 only: TORCH_CUDA_ARCH_LIST=9.0a,
# FLASH_MLA_DISABLE_SM100=1, DEEP_SELECT_CUDA_ARCHS=90a), installs each wheel into
# build/kernel_libs/site_<lib> (pip --target; all of them merged into build/kernel_libs/site, the
# PYTHONPATH entry), and writes to $OUT (flat, at most 7 files): klib_<lib>.tar.xz (the installed
# package: carry it as .gpu/klib_<lib>.tar.xz and run `install` to skip the build next time),
# build_<lib>.log and versions.txt. Each library's build gets KLIBS_BUILD_TIMEOUT_S seconds (default
# 540): a call has at most 600 s.
#
# DeepGEMM compiles its kernels at run time (JIT, nvcc or NVRTC): it needs CUDA_HOME (or nvcc on PATH),
# finds cute/cutlass in its installed package (its build copies them in), and caches compiled kernels in
# DG_JIT_CACHE_DIR (set by `install`/`env` below to build/kernel_libs/dg_jit_cache so a warm machine
# reuses them).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KL=${KLIBS_DIR:-$ROOT/build/kernel_libs}
OUT=${OUT:-$KL/out}
MIRROR=${KLIBS_MIRROR:-/work/.mirror}

# Pinned commits (read 2026-12-05; see docs/cuda_backend.md, "Kernel libraries").
FLASH_MLA_COMMIT=9241ae3ef9bac614dd25e45e507e089f888280e0     # FlashMLA main, 2026-04-29
FLASH_MLA_CUTLASS=147f5673d0c1c3dcf66f78d677fd647e4a020219    # its csrc/cutlass submodule
DEEP_GEMM_COMMIT=54e22612409371d6364144b69086735beb54e98b     # DeepGEMM main, 2026-06-23 (v2.6.1)
DEEP_GEMM_CUTLASS=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8    # its third-party/cutlass submodule
DEEP_GEMM_FMT=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28        # its third-party/fmt submodule

log() { echo "[build_kernel_libs] $*" >&2; }

# archive_tree GIT_DIR COMMIT DEST [PATH ...]: the tree at COMMIT (or only PATHs) extracted under DEST
archive_tree() {
  local git=$1 commit=$2 dest=$3
  shift 3
  mkdir -p "$dest"
  git --git-dir="$git" archive --format=tar "$commit" "$@" | tar -x -C "$dest" || return 1
}

cmd_pack() {
  local archive=${1:-$ROOT/.gpu/kernel_src.tar.xz}
  local fm=${FLASH_MLA_GIT:-$MIRROR/deepseek-ai+FlashMLA/repo}
  local dg=${DEEP_GEMM_GIT:-$MIRROR/deepseek-ai+DeepGEMM/repo}
  local cu=${CUTLASS_GIT:-$MIRROR/NVIDIA+cutlass/repo}
  local fmt=${FMT_GIT:-$MIRROR/fmtlib+fmt/repo}
  local stage
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' RETURN
  local s=$stage/kernel_src
  log "FlashMLA $FLASH_MLA_COMMIT"
  archive_tree "$fm" "$FLASH_MLA_COMMIT" "$s/FlashMLA" csrc flash_mla tests setup.py LICENSE README.md || return 1
  rm -rf "$s/FlashMLA/csrc/cutlass"
  archive_tree "$cu" "$FLASH_MLA_CUTLASS" "$s/FlashMLA/csrc/cutlass" include tools/util/include LICENSE.txt || return 1
  log "DeepGEMM $DEEP_GEMM_COMMIT"
  archive_tree "$dg" "$DEEP_GEMM_COMMIT" "$s/DeepGEMM" || return 1
  rm -rf "$s/DeepGEMM/third-party/cutlass" "$s/DeepGEMM/third-party/fmt"
  archive_tree "$cu" "$DEEP_GEMM_CUTLASS" "$s/DeepGEMM/third-party/cutlass" include LICENSE.txt || return 1
  archive_tree "$fmt" "$DEEP_GEMM_FMT" "$s/DeepGEMM/third-party/fmt" include LICENSE || return 1
  if [ -n "${DEEP_SELECT_SRC:-}" ]; then
    log "DeepSelect from $DEEP_SELECT_SRC"
    mkdir -p "$s/DeepSelect"
    (cd "$DEEP_SELECT_SRC" && tar -c --exclude=.git --exclude=assets .) | tar -x -C "$s/DeepSelect" || return 1
  else
    log "DeepSelect: no source tree (DEEP_SELECT_SRC unset), left out"
  fi
  {
    echo "FlashMLA $FLASH_MLA_COMMIT cutlass $FLASH_MLA_CUTLASS"
    echo "DeepGEMM $DEEP_GEMM_COMMIT cutlass $DEEP_GEMM_CUTLASS fmt $DEEP_GEMM_FMT"
    [ -n "${DEEP_SELECT_SRC:-}" ] && echo "DeepSelect $(git -C "$DEEP_SELECT_SRC" rev-parse HEAD 2>/dev/null || echo unknown)"
  } >"$s/COMMITS"
  mkdir -p "$(dirname "$archive")"
  tar -C "$stage" -c kernel_src | xz -T0 -6 >"$archive" || return 1
  log "wrote $archive ($(du -h "$archive" | cut -f1); unpacked $(du -sh "$s" | cut -f1))"
}

unpack_src() {
  local archive=${KLIBS_SRC_ARCHIVE:-$ROOT/.gpu/kernel_src.tar.xz}
  if [ -d "$KL/src/kernel_src" ] && [ "$KL/src/.stamp" -nt "$archive" ]; then
    return 0  # a warm machine keeps the unpacked tree (and any partial build inside it)
  fi
  [ -f "$archive" ] || { log "no source archive at $archive (run pack here and carry .gpu)"; return 1; }
  rm -rf "$KL/src" && mkdir -p "$KL/src" && tar -xJf "$archive" -C "$KL/src" && touch "$KL/src/.stamp"
}

build_env() {
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
  export FLASH_MLA_DISABLE_SM100=${FLASH_MLA_DISABLE_SM100:-1}
  export DEEP_SELECT_CUDA_ARCHS=${DEEP_SELECT_CUDA_ARCHS:-90a}
  export DEEP_SELECT_BUILD_TARGET_PLATFORM=${DEEP_SELECT_BUILD_TARGET_PLATFORM:-CUDA}
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  export NVCC_THREADS=${NVCC_THREADS:-4}
  export DG_USE_LOCAL_VERSION=1 DG_FORCE_BUILD=1  # build from source: never try to download a wheel
  if [ -z "${CUDA_HOME:-}" ]; then
    if command -v nvcc >/dev/null; then
      CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
    else
      CUDA_HOME=/usr/local/cuda
    fi
    export CUDA_HOME
  fi
  export PATH=$CUDA_HOME/bin:$PATH
}

build_one() {
  local lib=$1 dir
  case $lib in
    flash_mla) dir=FlashMLA ;;
    deep_gemm) dir=DeepGEMM ;;
    deep_select) dir=DeepSelect ;;
    *) log "unknown library $lib (flash_mla, deep_gemm, deep_select)"; return 2 ;;
  esac
  local src=$KL/src/kernel_src/$dir
  [ -d "$src" ] || { log "$lib: no source in the archive"; return 1; }
  if [ "$lib" = deep_gemm ] && ! python3 -c 'import wheel.bdist_wheel, packaging' 2>/dev/null; then
    # DeepGEMM's setup.py imports both; there is no network on the device to fetch them
    log "deep_gemm: its setup.py needs the 'wheel' and 'packaging' packages (carry them as wheels, .whl)"
    return 1
  fi
  mkdir -p "$OUT" "$KL/wheels"
  local t0=$SECONDS rc
  log "$lib: building in $src"
  rm -f "$KL"/wheels/"$lib"-*.whl
  (cd "$src" && timeout -s INT "${KLIBS_BUILD_TIMEOUT_S:-540}" \
    python3 -m pip wheel -v --no-build-isolation --no-deps -w "$KL/wheels" .) >"$OUT/build_$lib.log" 2>&1
  rc=$?
  log "$lib: rc=$rc in $((SECONDS - t0)) s (log: build_$lib.log)"
  [ $rc -eq 0 ] || { tail -30 "$OUT/build_$lib.log" >&2; return $rc; }
  # one installed tree per library, so each comes back as its own archive (at most 16 MiB a file)
  rm -rf "$KL/site_$lib" && python3 -m pip install -q --no-deps --target "$KL/site_$lib" "$KL"/wheels/"$lib"-*.whl || return 1
  tar -C "$KL/site_$lib" -c . | xz -T0 -6 >"$OUT/klib_$lib.tar.xz"
  log "$lib: klib_$lib.tar.xz $(du -h "$OUT/klib_$lib.tar.xz" | cut -f1) (carry it as .gpu/klib_$lib.tar.xz to skip the build)"
  link_site
}

# build/kernel_libs/site: every built (or installed) library's tree, merged (the PYTHONPATH entry)
link_site() {
  mkdir -p "$KL/site"
  local d
  for d in "$KL"/site_*; do
    [ -d "$d" ] && cp -a "$d"/. "$KL/site"/
  done
}

cmd_build() {
  build_env
  unpack_src || return 1
  local libs=("$@") failed=0
  [ ${#libs[@]} -gt 0 ] || libs=(flash_mla deep_gemm deep_select)
  for lib in "${libs[@]}"; do
    build_one "$lib" || failed=1
  done
  cp "$KL/src/kernel_src/COMMITS" "$OUT/versions.txt" 2>/dev/null
  return $failed
}

# `source scripts/build_kernel_libs.sh env` (or eval "$(bash ... env)") puts the built libraries on
# PYTHONPATH with DeepGEMM's JIT settings.
cmd_env() {
  build_env
  echo "export PYTHONPATH=$KL/site\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export CUDA_HOME=$CUDA_HOME"
  echo "export DG_JIT_CACHE_DIR=$KL/dg_jit_cache"
}

cmd_install() {  # install [ARCHIVE ...]: default .gpu/klib_*.tar.xz; a library already built here is kept
  local a lib
  local archives=("$@")
  [ ${#archives[@]} -gt 0 ] || archives=("$ROOT"/.gpu/klib_*.tar.xz)
  for a in "${archives[@]}"; do
    [ -f "$a" ] || continue
    lib=$(basename "$a" .tar.xz)
    lib=${lib#klib_}
    if [ ! -d "$KL/site_$lib" ]; then
      mkdir -p "$KL/site_$lib" && tar -xJf "$a" -C "$KL/site_$lib" || return 1
      log "$lib: installed from $a"
    fi
  done
  link_site
  mkdir -p "$KL/dg_jit_cache"
  cmd_env
}

cmd_check() {
  eval "$(cmd_env)"
  python3 - <<'EOF'
import importlib, sys
for lib in ("flash_mla", "deep_gemm", "deep_select"):
    try:
        m = importlib.import_module(lib)
        print(lib, "OK", getattr(m, "__version__", "?"), m.__file__)
    except Exception as e:  # report every library, not only the first failure
        print(lib, "FAIL", type(e).__name__, e, file=sys.stdout)
EOF
}

sub=${1:-}
[ $# -gt 0 ] && shift
case $sub in
  pack) cmd_pack "$@" ;;
  build) cmd_build "$@" ;;
  unpack) unpack_src ;;
  install) cmd_install "$@" ;;
  env) cmd_env ;;
  check) cmd_check ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac
