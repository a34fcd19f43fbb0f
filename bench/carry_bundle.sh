#!/usr/bin/env bash
# Build .carry/site312.tar.xz: the Python packages the serving stack needs that the lent H200
# image lacks (Ray Serve, pydantic, starlette, wetext, ...), as cp312 wheels unpacked into one
# tree (ray-serve-notes §3.3). On the GPU machine (bench/device_serve.sh does this):
#   mkdir /tmp/site && tar -C /tmp/site -xJf .carry/site312.tar.xz && export PYTHONPATH=/tmp/site:$PWD
# Pass `carry: [".carry"]` to the device run. ~6 min on 2 cores, ~45 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.carry
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Already in the H200 image (device KINDS.md, 2026-11-17): not carried.
HAVE="aiohttp aiosignal anyio attrs certifi charset_normalizer click cloudpickle filelock frozenlist fsspec grpcio
h11 httpcore httpx idna jinja2 markupsafe msgpack multidict numpy packaging pillow prometheus_client propcache
protobuf psutil pyyaml requests rich setuptools six typing_extensions urllib3 yarl pygments markdown_it_py mdurl
tqdm scipy matplotlib onnx onnxruntime safetensors transformers tokenizers huggingface_hub regex torch"
PLAT=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_5_x86_64; do PLAT+=(--platform "$p"); done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
  -d "$WORK/dl" "ray[serve]==2.60.0" wetext==0.1.8 soundfile "pydantic>=2.5,<3" "starlette>=1.0.1" \
  "python-multipart>=0.0.20" "grpcio-reflection==1.84.0"
keep=()
for whl in "$WORK"/dl/*.whl; do
  name=$(basename "$whl" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
  case " $(echo $HAVE | tr 'A-Z-' 'a-z_') " in *" $name "*) ;; *) keep+=("$whl") ;; esac
done
echo "carrying ${#keep[@]} wheels"
python3 -m pip install -q --no-deps --no-compile --target "$WORK/site" --python-version 3.12 --implementation cp \
  --only-binary :all: "${keep[@]}"
rm -rf "$WORK/site/ray/jars" "$WORK/site/ray/rllib" "$WORK/site/bin"
find "$WORK/site" -name '*.js.map' -delete
# virtualenv (a Ray dependency) only seeds new environments from its embedded pip/setuptools
# wheels: never here, and ~5 MB of the 64 MiB a device call carries (with the tracked tree).
rm -rf "$WORK/site/virtualenv/seed/wheels/embed"/*.whl "$WORK"/site/*.dist-info/sboms
mkdir -p "$OUT"
# -9e: 50.2 MB at -6 left the tracked tree (16 MB, 2026-12-07) no room under a call's 64 MiB
tar -C "$WORK/site" -cf - . | xz -T2 -9e > "$OUT/site312.tar.xz"
ls -la "$OUT/site312.tar.xz"
