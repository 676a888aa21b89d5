// GgmlMatMul: y[..., rows] = x[..., cols] · W[rows, cols]ᵀ for W in a GGUF block type, computed by
// ggml's own CPU kernels (llama-cpp-python's libggml-cpu): a ggml mul_mat node over a slice of the
// weight rows per thread, so ggml quantizes x to the type's vec_dot type (from_float) and picks the
// kernel llama.cpp's mul_mat picks (repacked GEMM/GEMV, tiled K-quant GEMM, vec_dot), which is the
// arithmetic llama.cpp runs on a CPU. The CPU plugin has no kernel for this op, so it calls
// evaluate() once per inference on one thread with the tensors in place; the rows are divided
// over the plugin's own thread pool here (ov::parallel_for). GgmlFfn (a SwiGLU feed-forward) and
// GgmlMoe (a mixture of experts after its router) are several such nodes as one op, as llama.cpp's
// graph has them; GgmlMatMulId is mixture-of-experts rows by vec_dot.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include <mutex>

#include "delta_rule.hpp"
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "openvino/core/extension.hpp"
#include "openvino/core/op_extension.hpp"
#include "openvino/core/parallel.hpp"
#include "openvino/op/op.hpp"

namespace kafila {

// ggml's own log (a line per repacked tensor at debug level) would go to the member's stderr:
// warnings and errors only.
static void log_warnings(enum ggml_log_level level, const char* text, void*) {
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// ggml's log and its CPU tables (f16 conversions), once per process, before any kernel runs.
static void ggml_ready() {
    static const bool ready = (ggml_log_set(log_warnings, nullptr), ggml_cpu_init(), true);
    (void)ready;
}

// A per-thread scratch buffer of n bytes. One sized for a long prompt's step is given back at the
// next small step (glibc returns such blocks to the system), so a member's memory falls back after
// a long prompt as the plugin's own buffers do (tests/test_scratch_release.py).
static uint8_t* scratch(std::vector<uint8_t>& buffer, size_t n) {
    if (buffer.capacity() > 2 * n + (1u << 20)) std::vector<uint8_t>().swap(buffer);
    buffer.resize(n);
    return buffer.data();
}

// n rows of x in the dot product's type `act_type`, as llama.cpp quantizes src1 (from_float, or a
// copy where the vec_dot type is f32 itself), in the calling thread's buffer, over the plugin's
// threads. (A thread_local buffer named inside the lambda would be each worker's own: its address
// is taken here, on the calling thread.)
static const uint8_t* quantize_rows(const float* x, size_t n, int64_t cols, ggml_type act_type) {
    const auto* act = ggml_get_type_traits_cpu(act_type);
    const size_t q_bytes = ggml_row_size(act_type, cols);
    thread_local std::vector<uint8_t> buffer;
    uint8_t* const out = scratch(buffer, n * q_bytes);
    ov::parallel_for(n, [&](size_t i) {
        if (act->from_float != nullptr) {
            act->from_float(x + i * cols, out + i * q_bytes, cols);
        } else {
            std::memcpy(out + i * q_bytes, x + i * cols, q_bytes);
        }
    });
    return out;
}

// A ggml threadpool of one thread for the calling thread (a plugin worker): a graph computed with
// it runs on that thread alone (n_graph 1, so ggml's barriers return at once, OpenMP or not).
static ggml_threadpool* own_threadpool() {
    struct Pool {
        ggml_threadpool* tp;
        Pool() {
            ggml_threadpool_params params = ggml_threadpool_params_default(1);
            tp = ggml_threadpool_new(&params);
        }
        ~Pool() { ggml_threadpool_free(tp); }
    };
    thread_local Pool pool;
    return pool.tp;
}

// llama.cpp's CPU_REPACK buffer type (its default for weights): the ggml CPU device's extra buffer
// types, asked for by name through the registry, as llama.cpp asks; null where this ggml has none.
static ggml_backend_buffer_type_t repack_buffer_type() {
    static ggml_backend_buffer_type_t found = [] {
        ggml_backend_reg_t reg = ggml_backend_cpu_reg();
        auto get = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
            ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"));
        if (get == nullptr) return static_cast<ggml_backend_buffer_type_t>(nullptr);
        for (auto* t = get(ggml_backend_reg_dev_get(reg, 0)); t != nullptr && *t != nullptr; ++t) {
            if (std::strcmp(ggml_backend_buft_name(*t), "CPU_REPACK") == 0) return *t;
        }
        return static_cast<ggml_backend_buffer_type_t>(nullptr);
    }();
    return found;
}

// A weight matrix in llama.cpp's repacked layout (interleaved rows for its GEMM/GEMV kernels),
// made once from the file's blocks; empty where ggml has no repacked form of the type or shape.
struct Repacked {
    ggml_context* ctx = nullptr;
    ggml_backend_buffer_t buffer = nullptr;
    ggml_tensor* w = nullptr;

    Repacked(int64_t type, int64_t rows, int64_t cols, const uint8_t* data, size_t bytes) {
        ggml_backend_buffer_type_t buft = repack_buffer_type();
        if (buft == nullptr) return;
        ctx = ggml_init({ggml_tensor_overhead(), nullptr, true});
        w = ggml_new_tensor_2d(ctx, static_cast<ggml_type>(type), cols, rows);
        buffer = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);  // sets w->extra: its repacking
        if (buffer == nullptr || w->extra == nullptr) {
            w = nullptr;
            return;
        }
        ggml_backend_tensor_set(w, data, 0, bytes);  // repacks
    }
    ~Repacked() {
        if (buffer != nullptr) ggml_backend_buffer_free(buffer);
        if (ctx != nullptr) ggml_free(ctx);
    }
};

// One weight matrix of the file's blocks as llama.cpp holds it: repacked at its first use where
// ggml has an interleaved layout for the type here (and `repack` asks for it), else the blocks in
// place. A slice of its rows is a ggml tensor whose buffer and traits make ggml's mul_mat take the
// kernel llama.cpp's would (the repacked GEMM/GEMV; else the tiled K-quant GEMM for 8 rows of x or
// more, vec_dot below that).
class Matrix {
public:
    Matrix(int64_t type, int64_t rows, int64_t cols, bool repack)
        : type(type), rows(rows), cols(cols), m_repack(repack) {}

    size_t row_bytes() const { return ggml_row_size(static_cast<ggml_type>(type), cols); }
    bool valid() const {
        ggml_ready();
        if (type < 0 || type >= GGML_TYPE_COUNT) return false;
        const auto* traits = ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
        return traits->vec_dot != nullptr && cols % ggml_blck_size(static_cast<ggml_type>(type)) == 0;
    }

    // Rows r0..r1 of the matrix whose file bytes are `data` (the same bytes at every step).
    ggml_tensor* slice(ggml_context* ctx, const uint8_t* data, int64_t r0, int64_t r1) const {
        std::call_once(m_once, [&] {
            if (m_repack) m_repacked = std::make_shared<Repacked>(type, rows, cols, data, rows * row_bytes());
        });
        const bool packed = m_repacked && m_repacked->w != nullptr;
        ggml_tensor* w = ggml_new_tensor_2d(ctx, static_cast<ggml_type>(type), cols, r1 - r0);
        w->data = (packed ? static_cast<uint8_t*>(m_repacked->w->data) : const_cast<uint8_t*>(data)) + r0 * row_bytes();
        w->buffer = packed ? m_repacked->buffer : nullptr;
        w->extra = packed ? m_repacked->w->extra : nullptr;
        ggml_set_name(w, "w");  // named, or building the graph names each by snprintf (µs a step)
        return w;
    }

    int64_t type, rows, cols;

private:
    bool m_repack;
    mutable std::once_flag m_once;
    mutable std::shared_ptr<Repacked> m_repacked;
};

// The row slices a matrix of `rows` rows is divided into over the plugin's threads: whole groups
// of 16 (a multiple of every interleave ggml repacks with), one slice per thread.
static int64_t slice_rows(int64_t rows) {
    constexpr int64_t kGroup = 16;
    const int64_t threads = std::max(1, parallel_get_max_threads());
    return ((rows + threads - 1) / threads + kGroup - 1) / kGroup * kGroup;
}

// fn(r0, r1) for each of those slices of `rows`, over the plugin's threads.
template <class Fn>
static void for_row_slices(int64_t rows, Fn fn) {
    const int64_t per = slice_rows(rows);
    ov::parallel_for(static_cast<size_t>((rows + per - 1) / per), [&](size_t t) {
        const int64_t r0 = static_cast<int64_t>(t) * per;
        fn(r0, std::min(rows, r0 + per));
    });
}

// An f32 tensor [cols, n] over `data` (row stride `stride` floats), named.
static ggml_tensor* f32_view(ggml_context* ctx, float* data, int64_t cols, int64_t n, int64_t stride, const char* name) {
    ggml_tensor* t = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, cols, n);
    t->data = data;
    t->nb[1] = static_cast<size_t>(stride) * sizeof(float);
    t->nb[2] = t->nb[3] = t->nb[1] * n;
    ggml_set_name(t, name);
    return t;
}

// Runs `build` (which adds nodes to a fresh context and returns the last) as a ggml graph on the
// calling thread, by a one-thread ggml threadpool of its own: no OpenMP team competes with the
// plugin's threads for the cores. Each task quantizes x for itself (ggml's mul_mat does so first),
// the cost of needing no barrier between the plugin's threads.
template <class Build>
static void compute_here(int nodes, Build build) {
    const size_t size = 4 * nodes;  // the graph's room for its nodes and leaves (its hash set)
    const size_t meta = size * ggml_tensor_overhead() + ggml_graph_overhead_custom(size, false);
    thread_local std::vector<uint8_t> meta_buf, work;
    meta_buf.resize(meta);
    ggml_context* ctx = ggml_init({meta, meta_buf.data(), true});
    ggml_cgraph* graph = ggml_new_graph_custom(ctx, size, false);
    ggml_build_forward_expand(graph, build(ctx));
    ggml_cplan plan = ggml_graph_plan(graph, 1, own_threadpool());
    plan.work_data = scratch(work, plan.work_size);
    ggml_graph_compute(graph, &plan);
    ggml_free(ctx);
}

static void check_weights(const ov::Node* node, size_t port, const Matrix& m) {
    const auto& w = node->get_input_partial_shape(port);
    NODE_VALIDATION_CHECK(node, node->get_input_element_type(port) == ov::element::u8, "weights must be u8 bytes");
    NODE_VALIDATION_CHECK(node, w.is_static() && ov::shape_size(w.to_shape()) == m.rows * m.row_bytes(),
                          "weights hold ", w, " bytes, not ", m.rows, " rows of ", m.row_bytes());
}

// x's shape with its last dimension `cols` replaced by `out` (validated).
static ov::PartialShape out_shape(const ov::Node* node, int64_t cols, int64_t out) {
    NODE_VALIDATION_CHECK(node, node->get_input_element_type(0) == ov::element::f32, "x must be f32");
    auto shape = node->get_input_partial_shape(0);
    NODE_VALIDATION_CHECK(node, shape.rank().is_static() && shape.rank().get_length() >= 1, "x needs a rank");
    const auto last = shape.rank().get_length() - 1;
    NODE_VALIDATION_CHECK(node, shape[last].compatible(cols), "x's last dimension ", shape[last], " is not ", cols);
    shape[last] = out;
    return shape;
}

// Points mul_mat's result [r1 - r0, n_x] at rows r0.. of y [n_x, rows].
static void place(ggml_tensor* yt, float* y, int64_t r0, int64_t rows, int64_t n_x) {
    yt->data = y + r0;
    yt->nb[1] = static_cast<size_t>(rows) * sizeof(float);
    yt->nb[2] = yt->nb[3] = yt->nb[1] * n_x;
    ggml_set_name(yt, "y");
}

// y = x · Wᵀ as a ggml mul_mat node per row slice, on the plugin's threads.
class GgmlMatMul : public ov::op::Op {
public:
    OPENVINO_OP("GgmlMatMul", "kafila");

    GgmlMatMul() = default;
    GgmlMatMul(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& w, int64_t type, int64_t rows, int64_t cols,
               bool repack = true)
        : Op({x, w}), m_repack(repack), m_type(type), m_rows(rows), m_cols(cols) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        if (!m_w) m_w = std::make_shared<Matrix>(m_type, m_rows, m_cols, m_repack);  // keeps a repacked copy made
        NODE_VALIDATION_CHECK(this, m_w->valid(), "ggml type ", m_type, " has no CPU dot product for ", m_cols, " columns");
        check_weights(this, 1, *m_w);
        set_output_type(0, ov::element::f32, out_shape(this, m_cols, m_rows));
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        check_new_args_count(this, args);
        return std::make_shared<GgmlMatMul>(args.at(0), args.at(1), m_type, m_rows, m_cols, m_repack);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("type", m_type);
        visitor.on_attribute("rows", m_rows);
        visitor.on_attribute("cols", m_cols);
        visitor.on_attribute("repack", m_repack);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        ov::Shape shape = inputs[0].get_shape();
        const int64_t n_x = static_cast<int64_t>(ov::shape_size(shape)) / m_cols;
        shape.back() = m_rows;
        outputs[0].set_shape(shape);
        auto* x = const_cast<float*>(inputs[0].data<const float>());
        const auto* w = static_cast<const uint8_t*>(inputs[1].data());
        float* y = outputs[0].data<float>();
        for_row_slices(m_rows, [&](int64_t r0, int64_t r1) {
            compute_here(1, [&](ggml_context* ctx) {
                ggml_tensor* yt = ggml_mul_mat(ctx, m_w->slice(ctx, w, r0, r1), f32_view(ctx, x, m_cols, n_x, m_cols, "x"));
                place(yt, y, r0, m_rows, n_x);
                return yt;
            });
        });
        return true;
    }

private:
    bool m_repack = true;  // llama.cpp's repacked layout where ggml has one (its default)
    int64_t m_type = 0;
    int64_t m_rows = 0;
    int64_t m_cols = 0;
    std::shared_ptr<Matrix> m_w;  // the one clone the plugin executes holds its repacked copy
};

// GgmlFfn: a SwiGLU feed-forward as llama.cpp computes it (build_ffn: gate and up in parallel,
// ggml_swiglu_split, down): y = W_down · (silu(W_gate · x) ⊙ (W_up · x)), three matrices in the
// file's block types. One node where the graph had five (two matmuls with a split, the SiLU, the
// product, the down matmul), and the SiLU is ggml's own, as llama.cpp's. Two passes over the
// plugin's threads: slices of the F hidden units (gate, up and their product), then slices of
// down's rows over the whole product.
class GgmlFfn : public ov::op::Op {
public:
    OPENVINO_OP("GgmlFfn", "kafila");

    GgmlFfn() = default;
    GgmlFfn(const ov::OutputVector& args, int64_t gate_type, int64_t up_type, int64_t down_type, int64_t ffn,
            int64_t hidden, bool repack = true)
        : Op(args), m_repack(repack), m_gate_type(gate_type), m_up_type(up_type), m_down_type(down_type),
          m_ffn(ffn), m_hidden(hidden) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        if (!m_gate) {  // (once: a repacked copy made at a step is kept)
            m_gate = std::make_shared<Matrix>(m_gate_type, m_ffn, m_hidden, m_repack);
            m_up = std::make_shared<Matrix>(m_up_type, m_ffn, m_hidden, m_repack);
            m_down = std::make_shared<Matrix>(m_down_type, m_hidden, m_ffn, m_repack);
        }
        size_t port = 1;
        for (const auto* m : {m_gate.get(), m_up.get(), m_down.get()}) {
            NODE_VALIDATION_CHECK(this, m->valid(), "ggml type ", m->type, " has no CPU dot product for ", m->cols, " columns");
            check_weights(this, port++, *m);
        }
        set_output_type(0, ov::element::f32, out_shape(this, m_hidden, m_hidden));
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        check_new_args_count(this, args);
        return std::make_shared<GgmlFfn>(args, m_gate_type, m_up_type, m_down_type, m_ffn, m_hidden, m_repack);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("gate_type", m_gate_type);
        visitor.on_attribute("up_type", m_up_type);
        visitor.on_attribute("down_type", m_down_type);
        visitor.on_attribute("ffn", m_ffn);
        visitor.on_attribute("hidden", m_hidden);
        visitor.on_attribute("repack", m_repack);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Shape shape = inputs[0].get_shape();
        const int64_t n_x = static_cast<int64_t>(ov::shape_size(shape)) / m_hidden;
        outputs[0].set_shape(shape);
        auto* x = const_cast<float*>(inputs[0].data<const float>());
        const auto* gate = static_cast<const uint8_t*>(inputs[1].data());
        const auto* up = static_cast<const uint8_t*>(inputs[2].data());
        const auto* down = static_cast<const uint8_t*>(inputs[3].data());
        float* y = outputs[0].data<float>();
        thread_local std::vector<uint8_t> act_buf;  // the calling thread's: its address is taken here
        float* act = reinterpret_cast<float*>(scratch(act_buf, static_cast<size_t>(n_x * m_ffn) * sizeof(float)));
        for_row_slices(m_ffn, [&](int64_t r0, int64_t r1) {
            thread_local std::vector<uint8_t> gu_buf;
            auto* gu = reinterpret_cast<float*>(scratch(gu_buf, static_cast<size_t>(2 * n_x * (r1 - r0)) * sizeof(float)));
            compute_here(3, [&](ggml_context* ctx) {
                ggml_tensor* xt = f32_view(ctx, x, m_hidden, n_x, m_hidden, "x");
                ggml_tensor* g = ggml_mul_mat(ctx, m_gate->slice(ctx, gate, r0, r1), xt);
                ggml_tensor* u = ggml_mul_mat(ctx, m_up->slice(ctx, up, r0, r1), xt);
                g->data = gu, u->data = gu + n_x * (r1 - r0);
                ggml_set_name(g, "g"), ggml_set_name(u, "u");
                ggml_tensor* a = ggml_swiglu_split(ctx, g, u);  // [r1 - r0, n_x] within act's rows of m_ffn
                a->data = act + r0;
                a->nb[1] = static_cast<size_t>(m_ffn) * sizeof(float);
                a->nb[2] = a->nb[3] = a->nb[1] * n_x;
                ggml_set_name(a, "a");
                return a;
            });
        });
        for_row_slices(m_hidden, [&](int64_t r0, int64_t r1) {
            compute_here(1, [&](ggml_context* ctx) {
                ggml_tensor* yt = ggml_mul_mat(ctx, m_down->slice(ctx, down, r0, r1), f32_view(ctx, act, m_ffn, n_x, m_ffn, "a"));
                place(yt, y, r0, m_hidden, n_x);
                return yt;
            });
        });
        return true;
    }

private:
    bool m_repack = true;
    int64_t m_gate_type = 0, m_up_type = 0, m_down_type = 0;
    int64_t m_ffn = 0, m_hidden = 0;
    std::shared_ptr<Matrix> m_gate, m_up, m_down;
};

// GgmlGeglu: GELU(gate) ⊙ up as ggml computes it (ggml_geglu_split: its GELU reads an f16 table at the
// gate rounded to f16, llama.cpp's default), so the activation a following ggml product quantizes
// is llama.cpp's own (Gemma's GeGLU in the ggml form); rows over the plugin's threads.
class GgmlGeglu : public ov::op::Op {
public:
    OPENVINO_OP("GgmlGeglu", "kafila");

    GgmlGeglu() = default;
    GgmlGeglu(const ov::Output<ov::Node>& gate, const ov::Output<ov::Node>& up) : Op({gate, up}) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        ggml_ready();
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32 &&
                                        get_input_element_type(1) == ov::element::f32, "gate and up must be f32");
        const auto& g = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, g.rank().is_static() && g.rank().get_length() >= 1 && g[g.rank().get_length() - 1].is_static(),
                              "gate needs a static last dimension");
        set_output_type(0, ov::element::f32, g);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        check_new_args_count(this, args);
        return std::make_shared<GgmlGeglu>(args.at(0), args.at(1));
    }

    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Shape shape = inputs[0].get_shape();
        OPENVINO_ASSERT(inputs[1].get_shape() == shape, "GgmlGeglu: gate ", shape, " and up ", inputs[1].get_shape());
        outputs[0].set_shape(shape);
        const int64_t n = static_cast<int64_t>(shape.back());
        const int64_t rows = n ? static_cast<int64_t>(ov::shape_size(shape)) / n : 0;
        auto* g = const_cast<float*>(inputs[0].data<const float>());
        auto* u = const_cast<float*>(inputs[1].data<const float>());
        float* y = outputs[0].data<float>();
        const int64_t per = (rows + std::max(1, parallel_get_max_threads()) - 1) / std::max(1, parallel_get_max_threads());
        ov::parallel_for(static_cast<size_t>(per ? (rows + per - 1) / per : 0), [&](size_t t) {
            const int64_t r0 = static_cast<int64_t>(t) * per, r1 = std::min(rows, r0 + per);
            compute_here(1, [&](ggml_context* ctx) {
                ggml_tensor* a = ggml_geglu_split(ctx, f32_view(ctx, g + r0 * n, n, r1 - r0, n, "g"),
                                                  f32_view(ctx, u + r0 * n, n, r1 - r0, n, "u"));
                a->data = y + r0 * n;  // [n, r1 - r0], contiguous
                ggml_set_name(a, "a");
                return a;
            });
        });
        return true;
    }
};

// GgmlMatMulId: mixture-of-experts rows, as llama.cpp's mul_mat_id: y[t, j] = x[t, j or 0] · W[ids[t, j]]ᵀ
// for W [experts, rows, cols] in a GGUF block type, read from the file's blocks. Only the experts
// some row picked are read, each once for all the rows that picked it; every product is ggml's
// vec_dot on the x row quantized by from_float, over the CPU plugin's threads.
class GgmlMatMulId : public ov::op::Op {
public:
    OPENVINO_OP("GgmlMatMulId", "kafila");

    GgmlMatMulId() = default;
    GgmlMatMulId(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& ids, const ov::Output<ov::Node>& w,
                 int64_t type, int64_t experts, int64_t rows, int64_t cols)
        : Op({x, ids, w}), m_type(type), m_experts(experts), m_rows(rows), m_cols(cols) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        ggml_ready();
        const auto* traits = ggml_get_type_traits_cpu(static_cast<ggml_type>(m_type));
        NODE_VALIDATION_CHECK(this, m_type >= 0 && m_type < GGML_TYPE_COUNT && traits->vec_dot != nullptr,
                              "ggml type ", m_type, " has no CPU dot product");
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "x must be f32");
        // (the CPU plugin runs i64 as i32)
        NODE_VALIDATION_CHECK(this, get_input_element_type(1) == ov::element::i64 || get_input_element_type(1) == ov::element::i32,
                              "ids must be integers");
        NODE_VALIDATION_CHECK(this, get_input_element_type(2) == ov::element::u8, "weights must be u8 bytes");
        const auto& x = get_input_partial_shape(0);
        const auto& ids = get_input_partial_shape(1);
        NODE_VALIDATION_CHECK(this, x.rank().compatible(3) && ids.rank().compatible(2), "x [T, 1|k, cols], ids [T, k]");
        const auto& w = get_input_partial_shape(2);
        NODE_VALIDATION_CHECK(this, w.is_static() && ov::shape_size(w.to_shape()) == m_experts * m_rows * row_bytes(),
                              "weights hold ", w, " bytes, not ", m_experts, " × ", m_rows, " rows of ", row_bytes());
        set_output_type(0, ov::element::f32, ov::PartialShape{ids[0], ids[1], m_rows});
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        check_new_args_count(this, args);
        return std::make_shared<GgmlMatMulId>(args.at(0), args.at(1), args.at(2), m_type, m_experts, m_rows, m_cols);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("type", m_type);
        visitor.on_attribute("experts", m_experts);
        visitor.on_attribute("rows", m_rows);
        visitor.on_attribute("cols", m_cols);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto* traits = ggml_get_type_traits_cpu(static_cast<ggml_type>(m_type));
        const auto act_type = traits->vec_dot_type;
        const ov::Shape xs = inputs[0].get_shape(), is = inputs[1].get_shape();
        const size_t T = is[0], k = is[1], X = xs[1];
        OPENVINO_ASSERT(xs[0] == T && (X == 1 || X == k) && xs[2] == static_cast<size_t>(m_cols), "GgmlMatMulId: x ", xs, " for ids ", is);
        outputs[0].set_shape({T, k, static_cast<size_t>(m_rows)});
        const float* x = inputs[0].data<const float>();
        const bool wide = inputs[1].get_element_type() == ov::element::i64;
        const auto id = [&](size_t p) -> int64_t {
            return wide ? inputs[1].data<const int64_t>()[p] : inputs[1].data<const int32_t>()[p];
        };
        const auto* w = static_cast<const uint8_t*>(inputs[2].data());
        float* y = outputs[0].data<float>();
        const size_t w_bytes = row_bytes(), q_bytes = ggml_row_size(act_type, m_cols);
        const uint8_t* quantized = quantize_rows(x, T * X, m_cols, act_type);
        // Which (row of ids, slot) pairs each expert serves.
        std::vector<std::vector<uint32_t>> users(m_experts);
        for (size_t p = 0; p < T * k; ++p) {
            const int64_t e = id(p);
            OPENVINO_ASSERT(e >= 0 && e < m_experts, "GgmlMatMulId: expert id ", e, " of ", m_experts);
            users[e].push_back(static_cast<uint32_t>(p));
        }
        constexpr size_t kRowTile = 32;
        std::vector<std::pair<int64_t, size_t>> tasks;  // (expert, first row)
        for (int64_t e = 0; e < m_experts; ++e) {
            if (users[e].empty()) continue;
            for (size_t r = 0; r < static_cast<size_t>(m_rows); r += kRowTile) tasks.emplace_back(e, r);
        }
        ov::parallel_for(tasks.size(), [&](size_t t) {
            const auto [e, r0] = tasks[t];
            const size_t r1 = std::min<size_t>(m_rows, r0 + kRowTile);
            for (size_t r = r0; r < r1; ++r) {
                const uint8_t* wr = w + (static_cast<size_t>(e) * m_rows + r) * w_bytes;
                for (const uint32_t p : users[e]) {
                    const size_t xi = (p / k) * X + (X == 1 ? 0 : p % k);
                    traits->vec_dot(static_cast<int>(m_cols), y + p * m_rows + r, 0, wr, 0, quantized + xi * q_bytes, 0, 1);
                }
            }
        });
        return true;
    }

private:
    size_t row_bytes() const { return ggml_row_size(static_cast<ggml_type>(m_type), m_cols); }

    int64_t m_type = 0;
    int64_t m_experts = 0;
    int64_t m_rows = 0;
    int64_t m_cols = 0;
};

// A 3-D expert tensor [E, rows, cols] of the file's blocks: rows r0..r1 of every expert, as the
// `as` of a ggml mul_mat_id (plain blocks: llama.cpp's repacked mul_mat_id is not used here, see
// ggml_kernels.matmul_id).
// Rows r0..r1 of each of `experts` matrices of `cols` columns that lie `rows` rows apart from `data`.
static ggml_tensor* experts_slice(ggml_context* ctx, int64_t type, int64_t experts, int64_t rows, int64_t cols,
                                  const uint8_t* data, int64_t r0, int64_t r1) {
    const size_t row = ggml_row_size(static_cast<ggml_type>(type), cols);
    ggml_tensor* t = ggml_new_tensor_3d(ctx, static_cast<ggml_type>(type), cols, r1 - r0, experts);
    t->data = const_cast<uint8_t*>(data) + r0 * row;
    t->nb[2] = row * rows;
    t->nb[3] = t->nb[2] * experts;
    ggml_set_name(t, "experts");
    return t;
}

// GgmlMoe: a mixture-of-experts feed-forward as llama.cpp's build_moe_ffn computes it once the
// router has picked (ids [T, k]) and weighed (w [T, k]): for row t and slot j with i = ids[t, j],
// e_j = (W_down[i] · act(W_gate[i] · x_t (+ b_gate[i]), W_up[i] · x_t (+ b_up[i])) (× s[t, j]) (+ b_down[i])) · w[t, j],
// y_t = e_0 + e_1 + … in slot order; act is ggml_swiglu_split, ggml_swiglu_oai (gpt-oss) or
// ggml_geglu_split (Gemma 4); s the down matrix's per-expert scale of each slot's expert. Every
// step is the ggml node llama.cpp's graph has (mul_mat_id, add_id, the GLU, mul, add), on the
// file's blocks: only the picked experts are read. Two passes over the plugin's threads: slices of
// the F hidden units of every expert (gate, up, the GLU), then slices of down's H rows.
class GgmlMoe : public ov::op::Op {
public:
    OPENVINO_OP("GgmlMoe", "kafila");

    GgmlMoe() = default;
    GgmlMoe(const ov::OutputVector& args, int64_t gate_type, int64_t up_type, int64_t down_type, int64_t experts,
            int64_t ffn, int64_t hidden, bool oai, bool bias, bool gelu = false, bool scaled = false, bool fused = false)
        : Op(args), m_oai(oai), m_bias(bias), m_gelu(gelu), m_scaled(scaled), m_fused(fused), m_gate_type(gate_type),
          m_up_type(up_type), m_down_type(down_type), m_experts(experts), m_ffn(ffn), m_hidden(hidden) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == (m_bias ? 9u : 6u) + (m_scaled ? 1u : 0u),
                              "x, ids, w, gate, up, down (and their biases, and the slots' down scales)");
        NODE_VALIDATION_CHECK(this, !(m_oai && m_gelu), "one activation: swiglu_oai or geglu");
        // fused: gate and up are both the one [E, 2F, H] tensor (each expert's F gate rows, then its F up rows)
        const int64_t gate_up_rows = m_experts * m_ffn * (m_fused ? 2 : 1);
        const Matrix gate(m_gate_type, gate_up_rows, m_hidden, false), up(m_up_type, gate_up_rows, m_hidden, false),
            down(m_down_type, m_experts * m_hidden, m_ffn, false);
        size_t port = 3;
        for (const auto* m : {&gate, &up, &down}) {
            NODE_VALIDATION_CHECK(this, m->valid(), "ggml type ", m->type, " has no CPU dot product for ", m->cols, " columns");
            check_weights(this, port++, *m);
        }
        NODE_VALIDATION_CHECK(this, get_input_element_type(1).is_integral() && get_input_element_type(2) == ov::element::f32,
                              "ids must be integers and w f32");
        const auto& ids = get_input_partial_shape(1);
        NODE_VALIDATION_CHECK(this, ids.rank().compatible(2) && get_input_partial_shape(2).rank().compatible(2),
                              "ids and w [T, k]");
        if (m_bias) {
            for (const auto& [p, n] : {std::pair<size_t, int64_t>{6, m_ffn}, {7, m_ffn}, {8, m_hidden}}) {
                const auto& b = get_input_partial_shape(p);
                NODE_VALIDATION_CHECK(this, get_input_element_type(p) == ov::element::f32 && b.is_static() &&
                                      ov::shape_size(b.to_shape()) == static_cast<size_t>(m_experts * n),
                                      "bias ", p, " must be f32 [", m_experts, ", ", n, "]");
            }
        }
        set_output_type(0, ov::element::f32, out_shape(this, m_hidden, m_hidden));
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        check_new_args_count(this, args);
        return std::make_shared<GgmlMoe>(args, m_gate_type, m_up_type, m_down_type, m_experts, m_ffn, m_hidden, m_oai, m_bias,
                                         m_gelu, m_scaled, m_fused);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("gate_type", m_gate_type);
        visitor.on_attribute("up_type", m_up_type);
        visitor.on_attribute("down_type", m_down_type);
        visitor.on_attribute("experts", m_experts);
        visitor.on_attribute("ffn", m_ffn);
        visitor.on_attribute("hidden", m_hidden);
        visitor.on_attribute("oai", m_oai);
        visitor.on_attribute("bias", m_bias);
        visitor.on_attribute("gelu", m_gelu);
        visitor.on_attribute("scaled", m_scaled);
        visitor.on_attribute("fused", m_fused);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Shape is = inputs[1].get_shape();
        const size_t scale_port = m_bias ? 9 : 6;
        OPENVINO_ASSERT(!m_scaled || inputs[scale_port].get_shape() == is, "GgmlMoe: the slots' down scales are not [T, k]");
        const int64_t T = static_cast<int64_t>(is[0]), k = static_cast<int64_t>(is[1]);
        OPENVINO_ASSERT(static_cast<int64_t>(ov::shape_size(inputs[0].get_shape())) == T * m_hidden &&
                        inputs[2].get_shape() == is, "GgmlMoe: x, ids and w disagree on T and k");
        outputs[0].set_shape(inputs[0].get_shape());
        // the ids as ggml's i32 [k, T] (the plugin may hand them over as i64), checked
        thread_local std::vector<int32_t> ids_buf;
        ids_buf.resize(static_cast<size_t>(T * k));
        const bool wide = inputs[1].get_element_type() == ov::element::i64;
        for (size_t p = 0; p < ids_buf.size(); ++p) {
            const int64_t e = wide ? inputs[1].data<const int64_t>()[p] : inputs[1].data<const int32_t>()[p];
            OPENVINO_ASSERT(e >= 0 && e < m_experts, "GgmlMoe: expert id ", e, " of ", m_experts);
            ids_buf[p] = static_cast<int32_t>(e);
        }
        int32_t* ids = ids_buf.data();
        auto* x = const_cast<float*>(inputs[0].data<const float>());
        auto* w = const_cast<float*>(inputs[2].data<const float>());
        auto bytes = [&](size_t p) { return static_cast<const uint8_t*>(inputs[p].data()); };
        auto bias = [&](size_t p) { return m_bias ? const_cast<float*>(inputs[p].data<const float>()) : nullptr; };
        float* y = outputs[0].data<float>();
        thread_local std::vector<uint8_t> act_buf;  // [T, k, F], the calling thread's
        float* act = reinterpret_cast<float*>(scratch(act_buf, static_cast<size_t>(T * k * m_ffn) * sizeof(float)));

        for_row_slices(m_ffn, [&](int64_t r0, int64_t r1) {
            const int64_t n = r1 - r0;
            compute_moe(static_cast<size_t>(6 * n * k * T) * sizeof(float), [&](ggml_context* leaf, ggml_context* ctx) {  // g, u, their biases, the GLU
                ggml_tensor* xv = ggml_new_tensor_3d(leaf, GGML_TYPE_F32, m_hidden, 1, T);  // b of mul_mat_id: [H, 1, T]
                xv->data = x;
                ggml_set_name(xv, "x");
                ggml_tensor* it = ids_view(leaf, ids, k, T);
                auto half = [&](size_t port, int64_t type, size_t bias_port, const char* name) {
                    // fused: every expert's 2F rows apart; up's F rows after gate's
                    const int64_t stride = m_fused ? 2 * m_ffn : m_ffn;
                    const size_t skip = m_fused && port == 4 ? m_ffn * ggml_row_size(static_cast<ggml_type>(type), m_hidden) : 0;
                    ggml_tensor* h = ggml_mul_mat_id(ctx, experts_slice(leaf, type, m_experts, stride, m_hidden, bytes(port) + skip, r0, r1), xv, it);
                    if (m_bias) h = ggml_add_id(ctx, h, bias_view(leaf, bias(bias_port), r0, n, m_ffn), it);
                    ggml_set_name(h, name);
                    return h;
                };
                ggml_tensor* g = half(3, m_gate_type, 6, "g");
                ggml_tensor* u = half(4, m_up_type, 7, "u");
                ggml_tensor* a = m_oai ? ggml_swiglu_oai(ctx, g, u, 1.702f, 7.0f)
                                 : m_gelu ? ggml_geglu_split(ctx, g, u) : ggml_swiglu_split(ctx, g, u);
                a->data = act + r0;  // [n, k, T] within act's rows of F
                a->nb[1] = static_cast<size_t>(m_ffn) * sizeof(float);
                a->nb[2] = a->nb[1] * k;
                a->nb[3] = a->nb[2] * T;
                ggml_set_name(a, "a");
                return a;
            });
        });
        for_row_slices(m_hidden, [&](int64_t r0, int64_t r1) {
            const int64_t n = r1 - r0;
            compute_moe(static_cast<size_t>((5 * k + 2) * n * T) * sizeof(float), [&](ggml_context* leaf, ggml_context* ctx) {  // d, its scale, its bias, e, the adds
                ggml_tensor* av = ggml_new_tensor_3d(leaf, GGML_TYPE_F32, m_ffn, k, T);
                av->data = act;
                ggml_tensor* it = ids_view(leaf, ids, k, T);
                ggml_tensor* d = ggml_mul_mat_id(ctx, experts_slice(leaf, m_down_type, m_experts, m_hidden, m_ffn, bytes(5), r0, r1), av, it);
                if (m_scaled) {  // build_lora_mm_id's (W·x)·s, before the bias
                    ggml_tensor* sv = ggml_new_tensor_3d(leaf, GGML_TYPE_F32, 1, k, T);
                    sv->data = const_cast<float*>(inputs[scale_port].data<const float>());
                    d = ggml_mul(ctx, d, sv);
                }
                if (m_bias) d = ggml_add_id(ctx, d, bias_view(leaf, bias(8), r0, n, m_hidden), it);
                ggml_tensor* wv = ggml_new_tensor_3d(leaf, GGML_TYPE_F32, 1, k, T);
                wv->data = w;
                ggml_tensor* e = ggml_mul(ctx, d, wv);  // [n, k, T]
                ggml_tensor* out = ggml_view_2d(ctx, e, n, T, e->nb[2], 0);
                for (int64_t j = 1; j < k; ++j) out = ggml_add(ctx, out, ggml_view_2d(ctx, e, n, T, e->nb[2], j * e->nb[1]));
                if (k == 1) out = ggml_cont(ctx, out);
                place(out, y, r0, m_hidden, T);  // the last add writes y's columns r0.. itself
                return out;
            });
        });
        return true;
    }

private:
    static ggml_tensor* ids_view(ggml_context* leaf, int32_t* ids, int64_t k, int64_t T) {
        ggml_tensor* t = ggml_new_tensor_2d(leaf, GGML_TYPE_I32, k, T);
        t->data = ids;
        ggml_set_name(t, "ids");
        return t;
    }
    // Columns r0.. (n of them) of a bias [E, width], as add_id's b [n, E].
    ggml_tensor* bias_view(ggml_context* leaf, float* b, int64_t r0, int64_t n, int64_t width) const {
        return f32_view(leaf, b + r0, n, m_experts, width, "b");
    }

    // Like compute_here, with a second context that allocates the intermediate results (`bytes`
    // of them; the leaves' data are the op's tensors, set by `build`).
    template <class Build>
    static void compute_moe(size_t bytes, Build build) {
        constexpr size_t kNodes = 64;
        const size_t meta = kNodes * ggml_tensor_overhead() + ggml_graph_overhead_custom(kNodes, false);
        thread_local std::vector<uint8_t> leaf_buf, node_buf, work;
        leaf_buf.resize(meta);
        ggml_context* leaf = ggml_init({meta, leaf_buf.data(), true});
        const size_t room = meta + bytes + kNodes * 64;  // + each tensor's alignment
        ggml_context* ctx = ggml_init({room, scratch(node_buf, room), false});
        ggml_cgraph* graph = ggml_new_graph_custom(ctx, kNodes, false);
        ggml_build_forward_expand(graph, build(leaf, ctx));
        ggml_cplan plan = ggml_graph_plan(graph, 1, own_threadpool());
        plan.work_data = scratch(work, plan.work_size);
        ggml_graph_compute(graph, &plan);
        ggml_free(ctx);
        ggml_free(leaf);
    }

    bool m_oai = false, m_bias = false, m_gelu = false, m_scaled = false, m_fused = false;
    int64_t m_gate_type = 0, m_up_type = 0, m_down_type = 0;
    int64_t m_experts = 0, m_ffn = 0, m_hidden = 0;
};

}  // namespace kafila

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({
    std::make_shared<ov::OpExtension<kafila::GgmlMatMul>>(),
    std::make_shared<ov::OpExtension<kafila::GgmlFfn>>(),
    std::make_shared<ov::OpExtension<kafila::GgmlGeglu>>(),
    std::make_shared<ov::OpExtension<kafila::GgmlMatMulId>>(),
    std::make_shared<ov::OpExtension<kafila::GgmlMoe>>(),
    std::make_shared<ov::OpExtension<kafila::KafilaDeltaRule>>(),
}));
