// The Python module of kvbaton's kernels: the last part of their one translation unit (see prefill_attention.cpp).

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("bf16_dot") = kDotBf16;  // bf16 linear rounds its inputs to bf16 and uses vdpbf16ps
  m.def("pack", &pack, "a [out, in] weight in the layout linear() reads");
  m.def("linear", &linear, "x @ W^T (+ bias) over a weight from pack()");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta in place, then RMSNorm of it");
  m.def("rope_write", &rope_write, "rotate q/k, write k/v into the pool, return rotated q");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("attention", &attention, "decode attention over paged K/V", py::arg("q"), py::arg("k_pool"), py::arg("v_pool"),
        py::arg("layer"), py::arg("tables"), py::arg("lengths"), py::arg("block_size"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("head_norm_inplace", &head_norm_inplace, "RMSNorm of each q and k head of qkv rows, in place");
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm of many rows, vectorized and threaded (prefill)");
  m.def("rope_inplace", &rope_inplace, "rotate the q and k heads of qkv rows in place");
  m.def("prefill_attention", &prefill_attention, "causal attention of new (or scattered) tokens over paged K/V",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("layer"), py::arg("slots"), py::arg("first_slot"),
        py::arg("kv_len"), py::arg("scale"), py::arg("positions") = torch::empty({0}, torch::kInt64),
        py::arg("window") = 0, py::arg("softcap") = 0.0);
}
