#!/usr/bin/env bash
# Fuyou's two entry points, each doing every set-up step first (idempotent):
#
#   ./run.sh demo [args]    the main job: fine-tune a GPT-style model through fuyoud
#                           (examples/finetune.py; --nproc N: N data-parallel ranks
#                           under torchrun)
#   ./run.sh test [args]    the test suite (pytest; args go to pytest)
#   ./run.sh swap [args]    swap a 1 GiB tensor to SSD and back (examples/swap_roundtrip.py)
#
# Set-up: Debian packages (liburing-dev, a C compiler, Python headers, venv), a
# virtualenv at .venv, PyTorch (the CPU build on hosts without an NVIDIA GPU), and
# Fuyou itself, editable, with its C extensions (fuyoud._uring, fuyoud._lowp). Where
# the compiler and headers are installed (by this script, or already), the extensions
# must build: a failed build fails set-up, with the compiler's error (FUYOU_NATIVE=require,
# setup.py). Needs Python >= 3.11.
set -euo pipefail
cd "$(dirname "$0")"

log() { printf '\033[1m[fuyou]\033[0m %s\n' "$*" >&2; }

find_python() {
    for py in "${PYTHON:-}" python3.11 python3.12 python3.13 python3; do
        [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
        if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$py"; return 0
        fi
    done
    log "Python >= 3.11 is required (set PYTHON=/path/to/python3.11)"; exit 1
}

system_packages() {
    local py="$1" missing=()
    command -v dpkg-query >/dev/null 2>&1 || { log "not a Debian system: install liburing-dev, gcc and Python headers yourself"; return 0; }
    for pkg in liburing-dev gcc pkg-config; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    "$py" -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
    [ -e "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || missing+=(python3-dev)
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -eq 0 ]; then
        log "installing Debian packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        log "installing Debian packages with sudo: ${missing[*]}"
        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        log "missing Debian packages: ${missing[*]}"
        log "run as root: apt-get install ${missing[*]}   (without liburing-dev fuyoud uses its thread-pool I/O engine)"
    fi
}

install_torch() {
    local pip=".venv/bin/pip"
    .venv/bin/python -c 'import torch' 2>/dev/null && return 0
    if [ -n "${FUYOU_TORCH:-}" ]; then
        log "installing $FUYOU_TORCH"; $pip install -q "$FUYOU_TORCH"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        log "NVIDIA GPU found: installing the CUDA build of PyTorch"; $pip install -q "torch>=2.4"
    else
        log "no NVIDIA GPU: installing the CPU build of PyTorch"
        # A local CPU wheel if the host has one, else PyTorch's CPU index.
        $pip install -q "torch==2.13.0+cpu" 2>/dev/null \
            || $pip install -q torch --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
    fi
}

# What the C extensions need, present or not: "require" when a compiler, liburing's
# headers and Python's are all here (a failed build is then an error), else "optional"
# with the reason (the daemon then falls back: thread-pool I/O, the torch int8 codec).
native_mode() {
    local py="$1" missing=()
    command -v "${CC:-gcc}" >/dev/null 2>&1 || missing+=("a C compiler (${CC:-gcc})")
    { pkg-config --exists liburing 2>/dev/null || [ -e /usr/include/liburing.h ]; } || missing+=("liburing's headers")
    [ -e "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || missing+=("Python.h")
    if [ ${#missing[@]} -eq 0 ]; then
        echo require
    else
        log "C extensions optional: missing ${missing[*]} (fuyoud will use its fallbacks)"
        echo optional
    fi
}

setup() {
    local py; py="$(find_python)"
    system_packages "$py"
    if [ ! -x .venv/bin/python ]; then
        log "creating .venv with $("$py" --version)"
        "$py" -m venv .venv
    fi
    install_torch
    local native; native="$(native_mode "$py")"
    local check_native='import fuyoud._uring, fuyoud._lowp'
    # Reinstall Fuyou only when its build inputs changed (or a required extension is missing).
    local stamp=.venv/.fuyou-build-inputs want
    want="$( (cat pyproject.toml setup.py native/*; echo "native=$native") | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c 'import fuyoud, fuyou_client' 2>/dev/null \
            || { [ "$native" = require ] && ! .venv/bin/python -c "$check_native" 2>/dev/null; }; then
        log "installing fuyou (editable) and its dependencies (C extensions: $native)"
        rm -f "$stamp"
        .venv/bin/pip install -q "setuptools>=68" wheel "cffi>=1.16"
        if ! FUYOU_NATIVE="$native" .venv/bin/pip install -q --no-build-isolation -e ".[test]"; then
            log "set-up failed: installing fuyou did not succeed (see the errors above)"
            exit 1
        fi
        echo "$want" > "$stamp"
    fi
    if [ "$native" = require ] && ! .venv/bin/python -c "$check_native"; then
        log "set-up failed: the compiler and headers are installed, but fuyoud's C extensions do not import (above)"
        rm -f "$stamp"
        exit 1
    fi
    .venv/bin/python -c 'from fuyoud.io import uring; ok, why = uring.available(); print("[fuyou] io_uring engine:", "available" if ok else why)' >&2
}

# What the operations tests drive for real: systemd-analyze (and systemd-sysusers,
# systemd-tmpfiles) from Debian's systemd, and a Prometheus server. Prometheus is taken
# from Debian's package without installing it (dpkg-deb -x into .fuyou/tools), so
# running the tests never starts a system-wide Prometheus service.
test_tools() {
    command -v dpkg-query >/dev/null 2>&1 || return 0
    if ! command -v systemd-analyze >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
        log "installing Debian's systemd (for systemd-analyze verify)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null; } \
            || log "could not install systemd: its tests will be skipped"
    fi
    if ! command -v prometheus >/dev/null 2>&1 && [ ! -x .fuyou/tools/bin/prometheus ]; then
        log "fetching Debian's prometheus package into .fuyou/tools"
        local tmp; tmp="$(mktemp -d)"
        if (cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 \
                || { [ "$(id -u)" -eq 0 ] && apt-get update -qq && apt-get download prometheus >/dev/null 2>&1; }; }); then
            mkdir -p .fuyou/tools/bin
            dpkg-deb -x "$tmp"/prometheus_*.deb .fuyou/tools/pkg
            ln -sf "$PWD/.fuyou/tools/pkg/usr/bin/prometheus" .fuyou/tools/bin/prometheus
            ln -sf "$PWD/.fuyou/tools/pkg/usr/bin/promtool" .fuyou/tools/bin/promtool
        else
            log "could not fetch prometheus: the Prometheus integration test will be skipped"
        fi
        rm -rf "$tmp"
    fi
}

cmd="${1:-}"; shift || true
case "$cmd" in
    demo)
        setup
        # --nproc N: the demo data parallel, N ranks on this host under torchrun
        nproc=1 args=()
        while [ $# -gt 0 ]; do
            case "$1" in
                --nproc) nproc="$2"; shift 2 ;;
                --nproc=*) nproc="${1#*=}"; shift ;;
                *) args+=("$1"); shift ;;
            esac
        done
        if [ "$nproc" -gt 1 ]; then
            export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( ($(nproc) + nproc - 1) / nproc ))}"
            exec .venv/bin/torchrun --standalone --nproc-per-node "$nproc" examples/finetune.py "${args[@]}"
        fi
        exec .venv/bin/python examples/finetune.py "${args[@]}" ;;
    swap) setup; exec .venv/bin/python examples/swap_roundtrip.py "$@" ;;
    test) setup; test_tools; exec .venv/bin/python -m pytest "$@" ;;
    setup) setup ;;
    *) echo "usage: ./run.sh demo|test|swap|setup [args]" >&2; exit 2 ;;
esac
