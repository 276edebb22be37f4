"""The GPU lint's rules (kernels/gpu_lint.py) and the TTGIR reader under them (kernels/ttgir.py), on small texts.

The rules on real builds: tests/test_gpu_pairing.py (the top-k's histograms, old and shipped) and
tests/test_compile_check.py (every build in the suite is lint-clean).
"""

import numpy as np
import pytest

from flashkern.kernels import gpu_lint, ttgir

# The first H200 run's histogram, as Triton 3.9 built it at [1, 512] on 8 warps (topk_kernel's TTGIR, trimmed):
# the mask reshaped from #blocked2 (a column a thread, then +256), the bins from #blocked3 (two adjacent columns).
TTGIR = """\
#blocked1 = #ttg.blocked<{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [8], order = [0]}>
#blocked2 = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [1, 8], order = [1, 0]}>
#blocked3 = #ttg.blocked<{sizePerThread = [1, 2], threadsPerWarp = [1, 32], warpsPerCTA = [1, 8], order = [1, 0]}>
module {
  tt.func public @k(%arg0: !tt.ptr<i32>) {
    %c = arith.constant dense<-1> : tensor<512xi32, #blocked1> loc(#loc3)
    %eligible = arith.cmpi slt, %a, %b : tensor<1x512xi32, #blocked2> loc(#loc3)
    %counts = tt.reshape %eligible allow_reorder : tensor<1x512xi1, #blocked2> -> tensor<512xi1, #blocked1> loc(#loc3)
    %bins = tt.reshape %bin_of allow_reorder : tensor<1x512xi32, #blocked3> -> tensor<512xi32, #blocked1> loc(#loc3)
    %keep = arith.andi %counts, %counts : tensor<512xi1, #blocked1> loc(#loc3)
    %hist = tt.histogram %bins, %keep : tensor<512xi32, #blocked1> -> tensor<256xi32, #blocked1> loc(#loc4)
    %flat = tt.reshape %bin_of : tensor<1x512xi32, #blocked3> -> tensor<512xi32, #blocked1> loc(#loc3)
    %ok = arith.cmpi sge, %flat, %c : tensor<512xi32, #blocked1> loc(#loc3)
    %fine = tt.histogram %flat, %ok : tensor<512xi32, #blocked1> -> tensor<256xi32, #blocked1> loc(#loc4)
    tt.return loc(#loc3)
  } loc(#loc3)
} loc(#loc3)
#loc1 = loc("/src/topk.py":187:23)
#loc2 = loc("/src/topk.py":236:20)
#loc3 = loc("/src/topk.py":10:0)
#loc4 = loc(callsite(#loc1 at #loc2))
"""


def test_the_reader_finds_ops_layouts_and_inlined_locations():
    module = ttgir.Module(TTGIR)
    histograms = [op for op in module.ops if op.name == "tt.histogram"]
    assert [op.operands for op in histograms] == [("%bins", "%keep"), ("%flat", "%ok")]
    assert module.where(histograms[0]) == (("/src/topk.py", 187), ("/src/topk.py", 236))
    assert module.layout("#blocked3") == ttgir.Blocked((1, 2), (1, 32), (1, 8), (1, 0))
    assert module.orders("%keep") == module.orders("%counts") != module.orders("%bins")
    assert module.orders("%c") == frozenset() and module.orders("%ok") == {ttgir.LOGICAL}


def test_blocked_layouts_place_elements_as_triton_does():
    """Registers first along the fastest dim, then lanes, then warps; a shape past the tile repeats in registers."""
    pairs = ttgir.Blocked((1, 2), (1, 32), (1, 8), (1, 0)).owners((1, 512))
    assert pairs[0].tolist() == [0, 1] and pairs[1].tolist() == [2, 3] and pairs[32].tolist() == [64, 65]
    singles = ttgir.Blocked((1, 1), (1, 32), (1, 8), (1, 0)).owners((1, 512))
    assert singles[5].tolist() == [5, 261]
    rows = ttgir.Blocked((1, 1), (32, 1), (8, 1), (0, 1)).owners((4, 64))  # 256 threads over 4 rows: broadcast
    assert rows.shape == (256, 64) and sorted(set(rows.ravel().tolist())) == list(range(256))
    assert rows[1, :2].tolist() == [64, 65] and rows[4, 0] == 0  # lanes past the 4 rows hold copies


def test_a_reorder_pairs_the_gpus_registers():
    """The bins' reshape puts column 2 t + r of thread t's register r at element t + 256 r: element 1 holds the bin
    of column 2, element 256 that of column 1; the mask's reshape keeps its order."""
    module = ttgir.Module(TTGIR)
    (bins,) = module.orders("%bins")
    (mask,) = module.orders("%counts")
    perm = module.reorder_permutation(bins)
    assert perm[:4].tolist() == [0, 2, 4, 6] and perm[256:258].tolist() == [1, 3]
    assert np.array_equal(module.reorder_permutation(mask), np.arange(512))


def test_the_pairing_rule_flags_operands_of_different_orders_only():
    found = gpu_lint.reorder_pairing(ttgir.Module(TTGIR))
    assert len(found) == 1
    assert found[0].where == "topk.py:187 <- topk.py:236" and "2 orders" in found[0].detail
    assert gpu_lint.lint_ttgir(TTGIR) == (str(found[0]),)


def test_a_scan_of_a_reordered_tensor_is_flagged():
    text = TTGIR.replace("%fine = tt.histogram %flat, %ok", '%fine = "tt.scan"(%bins)')
    assert any('tt.scan' in h for h in gpu_lint.lint_ttgir(text))


CUDA = """\
extern "C" __global__ void __launch_bounds__(256, 1) k(int* a, int n_rows) {
  int lane = ((int)threadIdx.x) & 31;
  int warp = ((int)threadIdx.x) >> 5;
  float x = a[((int)threadIdx.x)];
  if (warp == 0) {
    a[0] = __shfl_xor_sync((uint)4294967295, a[0], 1, 32);
  }
  if (lane < 16) {
    a[1] = __shfl_xor_sync((uint)4294967295, a[1], 1, 32);
  } else {
    __syncthreads();
  }
  if (128 <= ((int)threadIdx.x)) {
    a[2] = __shfl_xor_sync((uint)4294967295, a[2], 1, 32);
    __syncthreads();
  }
  for (int i = 0; i < min(16, (n_rows - (((int)blockIdx.x) * 16))); ++i) {
    __syncthreads();
    a[3] = __shfl_up_sync((uint)4294967295, a[3], 1, 32);
  }
  for (int j = 0; j < x; ++j) {
    a[4] = __shfl_down_sync((uint)4294967295, a[4], 1, 32);
  }
}
"""


def test_shuffles_under_a_lane_dependent_branch_or_loop_are_flagged():
    """A branch on a warp's lanes (lane < 16) or a loop bound that varies by thread (x, loaded per thread) leave
    lanes out of a full-warp shuffle; branches on whole warps (warp == 0, 128 <= threadIdx.x) and loops over
    uniform bounds (blockIdx.x is not the local x) do not."""
    found = gpu_lint.divergent_shuffle(CUDA)
    assert [h.where for h in found] == ["line 9", "line 22"]
    assert "lane < 16" in found[0].detail


def test_barriers_under_a_thread_dependent_branch_are_flagged():
    """__syncthreads() under any branch that threads of a CTA can take apart, whole warps included."""
    found = gpu_lint.divergent_barrier(CUDA)
    assert [h.where for h in found] == ["line 11", "line 15"]


@pytest.mark.parametrize("mask", ["(uint)4294967295", "0xffffffff", "0xFFFFFFFFu"])
def test_every_spelling_of_the_full_mask_is_a_full_warp_shuffle(mask):
    source = f"void k() {{ int lane = threadIdx.x; if (lane < 3) {{ y = __shfl_sync({mask}, y, 0); }} }}"
    assert len(gpu_lint.divergent_shuffle(source)) == 1
