#!/usr/bin/env bash
# The server's packages the GPU machine's image lacks (fastapi, uvicorn, pydantic, llguidance and
# what they need), as wheels for its Python 3.12 on x86-64, at the versions requirements-ci.txt pins,
# into .whl/ (git-ignored). A GPU run that starts `moestream serve` carries .whl and installs them first:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Usage (here, with network to the package registry): scripts/gpu/fetch_wheels.sh
set -eu
cd "$(dirname "$0")/../.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
pin() { grep -i "^$1==" requirements-ci.txt | head -1; }
py=${PYTHON:-python3}
wheel() {  # name==version: a manylinux or pure wheel for CPython 3.12 x86-64
  $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
    --abi none --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform any -d .whl "$1"
}
for name in fastapi uvicorn pydantic llguidance; do wheel "$(pin $name)"; done
# what those need at the versions this checkout's environment resolved (not pinned in requirements-ci.txt)
for name in pydantic-core starlette annotated-types typing-inspection annotated-doc opentelemetry-api; do
  version=$($py -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  wheel "$name${version:+==$version}"
done
ls .whl
