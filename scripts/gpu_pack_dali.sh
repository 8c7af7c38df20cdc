#!/usr/bin/env bash
# Pack DALI for the lent GPU machine (CUDA 13 driver, Python 3.12, no DALI, no internet) into
# pieces that each fit one device call's 64 MiB carry: .whl/dali_site.tar.xz.part0..2, and
# .whl/dali_site.sha256 (the pieces' checksums, in joining order; carry it with the first piece:
# scripts/gpu_study.sh refuses a missing, corrupt or stray piece before unpacking).
#
#   bash scripts/gpu_pack_dali.sh      # here (needs the package registry), about 3 minutes
#
# The pieces hold DALI for CUDA 13 and its dependencies unpacked as one site folder (the Python
# 3.12 extension only; xz: 188 MB against 262 MB of wheels). Carry one piece per call
# (carry: [".whl/dali_site.tar.xz.part0", ".whl/dali_site.sha256"], then part1, then part2 with
# the run itself; the machine keeps ignored files while it stays warm); scripts/gpu_study.sh
# --pieces checks what has arrived, and the run unpacks them (its first step, docs/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
DALI_VERSION=${DALI_VERSION:-2.4.0}
PIECES=${PIECES:-3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PLAT=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64; do PLAT+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLAT[@]}" -d "$TMP/whl" "nvidia-dali-cuda130==$DALI_VERSION" \
  "nvidia-nvimgcodec-cu13>=0.9.0,<0.10.0" "nvidia-libnvcomp-cu13==5.3.0.16" "nvidia-nvjpeg>=13,<14" \
  "astunparse==1.6.3" "gast==0.6.0" optree nvtx makefun "libcst~=1.8"
mkdir "$TMP/site"
for w in "$TMP"/whl/*.whl; do (cd "$TMP/site" && unzip -q -o "$w"); done
# only Python 3.12's extension; the wheel's scripts are not needed
find "$TMP/site/nvidia/dali" -maxdepth 1 -name 'backend_impl.cpython-*.so' ! -name '*cpython-312-*' -delete
rm -rf "$TMP"/site/*.data
mkdir -p .whl
rm -f .whl/dali_site.tar.xz.part* .whl/dali_site.sha256
tar -C "$TMP/site" -cf - . | xz -T0 -6 > "$TMP/site.tar.xz"
split -n "$PIECES" -d -a 1 "$TMP/site.tar.xz" .whl/dali_site.tar.xz.part
(cd .whl && sha256sum $(ls dali_site.tar.xz.part* | sort)) > .whl/dali_site.sha256
ls -l .whl/dali_site.tar.xz.part*
cat .whl/dali_site.sha256
echo "sha256 (whole): $(sha256sum "$TMP/site.tar.xz" | cut -c1-16)"
