#!/usr/bin/env bash
# The compiled code under AddressSanitizer and UndefinedBehaviorSanitizer (a CI job, after the suite):
#  1. the fuzzers over the lane's request reader and check (tests/fuzz/fuzz_request.c), over the
#     data plane's Get reader and check (tests/fuzz/fuzz_get.c), over the key index's walk and key
#     digests (tests/fuzz/fuzz_index.c) and over a large request's packed varint decoder
#     (tests/fuzz/fuzz_varint.c), for FUZZ_SECONDS each (default 30, 15, 15, 10);
#  2. the C extensions (the copy kernel, the data plane, the index walk and key digests, the
#     client's lane calls, the varint decoder) built with both sanitizers in a copy of the tree,
#     and the bad-input, lane, doorbell, data-plane, deadline, index, digest and large-request
#     tests (a CUDA pool's too, on the CuPy and driver stand-in) run against them in-process.
# Any report fails the job (-fno-sanitize-recover: UBSan aborts too). Uses ./.venv (scripts/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"

for name in fuzz_request fuzz_get fuzz_index fuzz_varint; do
    gcc $flags -DKV_STANDALONE -Wall -o "$work/$name" "tests/fuzz/$name.c"
done
# Two streams at once (the machine's two cores; 30 s and 40 s by default, against 70 s one after
# the other): each fuzzer keeps its own time, and the first fault fails its stream and the job.
fuzz() {  # NAME:SECONDS ...
    for spec in "$@"; do
        "$work/${spec%%:*}" "${spec#*:}" || return
    done
}
fuzz "fuzz_request:${FUZZ_SECONDS:-30}" >"$work/fuzz-a.log" 2>&1 &
fuzz_a=$!
fuzz "fuzz_get:${FUZZ_SECONDS:-15}" "fuzz_index:${FUZZ_SECONDS:-15}" "fuzz_varint:${FUZZ_SECONDS:-10}" \
    >"$work/fuzz-b.log" 2>&1 &
fuzz_b=$!
fuzz_rc=0
wait "$fuzz_a" || fuzz_rc=$?
wait "$fuzz_b" || fuzz_rc=$?
cat "$work/fuzz-a.log" "$work/fuzz-b.log"
[ "$fuzz_rc" -eq 0 ] || { echo "a fuzzer failed ($fuzz_rc)" >&2; exit "$fuzz_rc"; }

tar --exclude=./.venv --exclude=./build --exclude='*.so' --exclude=.git -cf - . | tar -xf - -C "$work"
(cd "$work" && CFLAGS="$flags" LDFLAGS="-fsanitize=address,undefined" \
    "$root/.venv/bin/python" setup.py -q build_ext --inplace >/dev/null 2>&1)
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
cd "$work"
# The extensions imported below are these sanitized builds, not the tree's (checked, not assumed).
LD_PRELOAD="$asan $ubsan" ASAN_OPTIONS=detect_leaks=0 "$root/.venv/bin/python" - <<'PY'
import os
from kvserver.api import _packed
from kvserver.copies import _kvcopy
from kvserver.lane import _kvlane
from kvserver.protocol import _wire
from kvserver.store import _kvindex
for m in (_kvcopy, _kvlane, _kvindex, _wire, _packed):
    assert m.__file__.startswith(os.getcwd()), m.__file__
    assert b"__asan_" in open(m.__file__, "rb").read(), f"{m.__file__} is not built with ASan"
from kvserver.protocol import compiled  # and each is taken: built from these sources (its digest)
for name in compiled.SOURCES:
    assert compiled.extension(name) is not None, f"{name} would not be used"
print("sanitized:", _kvcopy.__file__, _kvlane.__file__, _kvindex.__file__, _wire.__file__, _packed.__file__)
PY
# Python itself is not built with ASan: its arenas and exit-time allocations are not leaks of ours.
LD_PRELOAD="$asan $ubsan" \
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
KVSERVER_EXPECT_PLANE=1 KVSERVER_EXPECT_SANITIZED=1 \
    "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --timeout 300 \
    tests/test_dataplane.py tests/test_dataplane_cache.py tests/test_dataplane_alone.py tests/test_dataplane_gets.py tests/test_dataplane_tiers.py tests/test_dataplane_space.py tests/test_dataplane_puts.py tests/test_dataplane_cuda.py tests/test_dataplane_commands.py tests/test_lane.py tests/test_lane_doorbells.py tests/test_lane_ahead.py tests/test_lane_call.py tests/test_api_bad_input.py \
    tests/test_core_deadlines.py tests/test_store_index.py tests/test_store_digest.py tests/test_copies_stream.py \
    tests/test_api_wire.py
