#!/usr/bin/env bash
# The GPU machine's compiler, offline: a virtual environment whose Python, Numba and CUDA
# libraries (NVVM, NVRTC, nvJitLink and libdevice) are the H200 image's, so that
# `benchmarks/sass_census.py` and `python -m numbaflash.inspect` give here the registers and SASS
# the device builds. Checked on 2026-11-28: the image's libraries are these wheels byte for byte
# (md5), and this environment reproduced the device's census of the eight kernels that differ
# on other toolchains exactly (the pip CUDA 13.5 toolchain on Python 3.11 gave d96 v4 causal 241
# registers where the device gives 252; so did the device's 13.0 libraries on Python 3.11).
#
#   bash benchmarks/device_toolchain.sh /tmp/devtc          # once (needs pip's index)
#   /tmp/devtc/bin/python benchmarks/sass_census.py --archs sm_90a --match flash_backward_d96
#
# Versions as the image reports them (`pip show` on the device): Python 3.12, numba 0.68.0,
# llvmlite 0.50.0, numba-cuda 0.30.4, cuda-bindings 13.3.1, cuda-pathfinder 1.8.1, nvidia-nvjitlink
# and nvidia-cuda-nvrtc 13.0.88, libnvvm and libdevice of CUDA 13.0.88 (/usr/local/cuda there).
set -euo pipefail
dir=${1:?usage: device_toolchain.sh DIR}
python=${PYTHON312:-$(command -v python3.12 || true)}
[ -n "$python" ] || { echo "device_toolchain.sh: Python 3.12 is needed (set PYTHON312)" >&2; exit 2; }
"$python" -m venv "$dir"
"$dir/bin/python" -m pip install -q numba==0.68.0 llvmlite==0.50.0 numba-cuda==0.30.4 \
    cuda-bindings==13.3.1 cuda-pathfinder==1.8.1 numpy==2.4.6 cffi ml_dtypes \
    nvidia-nvjitlink==13.0.88 nvidia-cuda-nvrtc==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump
here=$(cd "$(dirname "$0")/.." && pwd)
echo "$here" > "$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/numbaflash-tree.pth"
"$dir/bin/python" - <<'EOF'
import sys
from cuda.bindings import nvjitlink, nvrtc
from numba.cuda.cudadrv import libs, nvvm
import numba
print(f"python {sys.version.split()[0]}, numba {numba.__version__}, nvJitLink {nvjitlink.version()}, "
      f"NVRTC {nvrtc.nvrtcVersion()[1:]}, NVVM IR {nvvm.NVVM().get_ir_version()}, libdevice {libs.get_libdevice()}")
EOF
