#!/usr/bin/env bash
# llama-cpp-python as llamapool builds it: the pinned sdist (pyproject.toml), llamapool's llama.cpp
# patches (patches/llama.cpp/*.patch, applied with `patch -p1` in the sdist's vendor/llama.cpp), then
# pip from that folder. The one build path: `make install` (and so `make run`/`make test`) calls it.
#
#   scripts/llama-cpp-build.sh fetch             the pinned sdist (downloaded once); prints its path
#   scripts/llama-cpp-build.sh source            fetch + unpack + patch; prints the patched folder
#   scripts/llama-cpp-build.sh install PYTHON    ... build its wheel (CMAKE_ARGS as given) and install it
#   scripts/llama-cpp-build.sh wheel DIR         ... and `pip wheel` it into DIR (python3; for other machines)
#   scripts/llama-cpp-build.sh check             every patch applies cleanly to a fresh copy (make test)
#
# Environment: LLAMA_CPP_CACHE (default build/llama-cpp-python: the sdist and the patched folder),
# LLAMA_CPP_PATCHES (another folder of patches),
# LLAMA_SDIST (an sdist archive to use instead of downloading one), PIP_BUILD_ARGS (extra pip
# arguments, e.g. --no-build-isolation where there is no network), CMAKE_ARGS (passed through).
# The sdist is fetched with `pip download` (PyPI, or pip's configured index) once and kept in the cache.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^ *"llama-cpp-python==\([^"]*\)".*/\1/p' "$here/pyproject.toml")
cache=${LLAMA_CPP_CACHE:-$here/build/llama-cpp-python}
patches=("${LLAMA_CPP_PATCHES:-$here/patches/llama.cpp}"/*.patch)
[ -e "${patches[0]}" ] || patches=()
py_fetch=${PYTHON_FETCH:-python3}

sdist() {  # the pinned sdist's path (downloaded into the cache once)
    if [ -n "${LLAMA_SDIST:-}" ]; then echo "$LLAMA_SDIST"; return; fi
    local f="$cache/llama_cpp_python-$version.tar.gz"
    if [ ! -s "$f" ]; then
        mkdir -p "$cache"
        echo "llama-cpp-build: fetching the llama-cpp-python $version sdist (76 MB) into $cache" >&2
        "$py_fetch" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$cache" >&2
    fi
    echo "$f"
}

apply_one() {  # apply patch $2 in folder $1: a failed hunk, fuzz, or a patch already in is an error
    if command -v patch >/dev/null; then
        local out
        out=$(patch -d "$1" -p1 --forward --batch --no-backup-if-mismatch < "$2" 2>&1) || { echo "$out"; return 1; }
        echo "$out"
        ! grep -qi "FAILED\|with fuzz" <<<"$out"
    else  # no patch(1): git apply (exact context, no fuzz) works outside a repository too
        (cd "$1" && git apply -p1 "$2")
    fi
}

unpack() {  # unpack the sdist into $1 (emptied first) and apply the patches; prints the source folder
    local dest=$1 archive src p
    archive=$(sdist)
    rm -rf "$dest" && mkdir -p "$dest"
    tar xzf "$archive" -C "$dest"
    src="$dest/llama_cpp_python-$version"
    [ -d "$src/vendor/llama.cpp" ] || { echo "llama-cpp-build: $archive has no vendor/llama.cpp" >&2; exit 1; }
    for p in "${patches[@]}"; do
        if ! out=$(apply_one "$src/vendor/llama.cpp" "$p" 2>&1); then
            echo "llama-cpp-build: $(basename "$p") does not apply cleanly to llama-cpp-python $version:" >&2
            echo "$out" >&2
            exit 1
        fi
        echo "llama-cpp-build: applied $(basename "$p")" >&2
    done
    echo "$src"
}

cmd=${1:-}
case "$cmd" in
    fetch)
        sdist ;;
    source)
        unpack "$cache/src" ;;
    install)
        # the wheel is kept in the cache, keyed by the version, the patches and CMAKE_ARGS: a new venv
        # (make clean; make install) reuses it instead of compiling llama.cpp again
        py=${2:?install PYTHON}
        key=$( { echo "$version ${CMAKE_ARGS:-}"; cat "${patches[@]}" /dev/null; } | sha256sum | cut -c1-16)
        whl_dir="$cache/wheels/$key"
        if ! ls "$whl_dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
            src=$(PYTHON_FETCH=$py unpack "$cache/src")
            rm -rf "$whl_dir" && mkdir -p "$whl_dir"
            # shellcheck disable=SC2086
            "$py" -m pip wheel --no-deps ${PIP_BUILD_ARGS:-} -w "$whl_dir.tmp" "$src"
            mv "$whl_dir.tmp"/llama_cpp_python-*.whl "$whl_dir"/ && rm -rf "$whl_dir.tmp"
        fi
        "$py" -m pip install -q --force-reinstall --no-deps "$whl_dir"/llama_cpp_python-*.whl ;;
    wheel)
        out=${2:?wheel DIR}
        src=$(unpack "$cache/src")
        mkdir -p "$out"
        # shellcheck disable=SC2086
        python3 -m pip wheel --no-deps ${PIP_BUILD_ARGS:-} -w "$out" "$src" ;;
    check)
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"' EXIT
        src=$(unpack "$tmp")
        echo "llama-cpp-build: ${#patches[@]} patch(es) apply cleanly to llama-cpp-python $version ($src)" ;;
    *)
        sed -n '2,18p' "$0" >&2; exit 2 ;;
esac
