// The Python module of prefixserve's CPU kernels: paged_decode.cpp (decode attention),
// layer_ops.cpp (the ops between a layer's matmuls), small_linear.cpp (matmuls at a few rows),
// tile_linear.cpp (bf16 matmuls over tile weights), int4_linear.cpp (over int4 weights) and argmax.cpp
// (greedy sampling's pick).
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <optional>
#include <string>

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, const std::optional<at::Tensor>& k_new,
                        const std::optional<at::Tensor>& v_new, int64_t ahead, int64_t hint,
                        int64_t scores, int64_t v_rows);
int64_t paged_decode_max_head_dim();
int64_t paged_decode_max_heads();
int64_t vector_width();
bool paged_decode_k_pairs();

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                         double eps);
void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);
at::Tensor silu_mul(const at::Tensor& gate_up);

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias);
int64_t small_linear_max_rows();

bool amx_tiles();
std::string tile_linear_engine();
at::Tensor tile_pack(const at::Tensor& w);
at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const std::optional<at::Tensor>& bias);

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);

at::Tensor argmax_rows(const at::Tensor& x);

// How many of torch's threads at::parallel_for spreads `tasks` tasks over, as every kernel's does:
// 1 in a build without OpenMP, where each kernel runs on the calling thread alone.
int64_t parallel_threads(int64_t tasks) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    seen |= uint64_t(1) << std::min<int64_t>(at::get_thread_num(), 63);
  });
  return __builtin_popcountll(seen.load());
}

// Every kernel runs with the GIL released, as torch's own ops do: the engine steps on its own
// thread, and the worker's event loop (streaming, health, stats) must run meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode,
        "Paged decode attention over a block-table KV cache, storing the new K/V rows first",
        no_gil, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("k_new") = py::none(),
        py::arg("v_new") = py::none(), py::arg("ahead") = 0,
        py::arg("hint") = 3, py::arg("scores") = 0, py::arg("v_rows") = 1);
  m.attr("max_head_dim") = paged_decode_max_head_dim();
  m.attr("max_heads") = paged_decode_max_heads();
  m.attr("vector_width") = vector_width();
  m.attr("k_pairs") = paged_decode_k_pairs();
  m.def("rms_norm", &rms_norm, "x [rows, dim] -> RMSNorm(x) * weight, a new tensor", no_gil);
  m.def("add_rms_norm_", &add_rms_norm_,
        "In place: residual += x, then x = RMSNorm(residual) * weight; returns x", no_gil);
  m.def("rope_", &rope_, "In place: RoPE on the first `heads` heads of qkv [rows, heads, dim]",
        no_gil);
  m.def("silu_mul", &silu_mul, "gate_up [rows, 2 I] -> silu(gate) * up [rows, I]", no_gil);
  m.def("small_linear", &small_linear, "x [M, K] (M small), w [N, K] -> x w^T + bias [M, N]",
        no_gil, py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.attr("small_linear_max_rows") = small_linear_max_rows();
  m.attr("amx_tiles") = amx_tiles();
  m.attr("tile_linear_engine") = tile_linear_engine();
  m.def("tile_pack", &tile_pack, "w [N, K] bfloat16 -> its copy in AMX tiles' layout", no_gil);
  m.def("tile_linear", &tile_linear,
        "x [M, K] bfloat16, w packed by tile_pack, N -> x w^T + bias [M, N] (AMX or pairs)",
        no_gil, py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("int4_linear", &int4_linear,
        "x [M, K], int4 weights packed [N, K / 2] with (scale, offset) per 32 inputs -> [M, N]",
        no_gil, py::arg("x"), py::arg("packed"), py::arg("scales"));
  m.def("argmax_rows", &argmax_rows,
        "x [rows, n] float32 -> each row's index of its first largest value [rows] int64",
        no_gil);
  m.def("parallel_threads", &parallel_threads,
        "How many of torch's threads the kernels' at::parallel_for spreads `tasks` tasks over",
        no_gil);
}
