// KafilaDeltaRule: the gated delta rule of a hybrid model's delta-net layer over a step's positions,
// as one op (backends/openvino/delta_net.py builds it where this library loads, else an OpenVINO
// Loop): for each row b and value head h, with the matrix state M [S_v, S_k] (row j: value j),
//     M ← exp(g_t)·M;  d = (v_t − M k_t)·β_t;  M ← M + d k_tᵀ;  o_t = (M q_t)·(1/sqrt(S))
// with llama.cpp's ggml-cpu gated_delta_net's f32 arithmetic (the fused op, llama.cpp's CPU default). The Loop ran a
// dozen tiny graph nodes per position; this op runs the heads over the plugin's threads, the dot
// products by ggml's f32 vec_dot, and M ← M + d kᵀ fused (one rounding) where ggml's vec_mad is
// (a CPU with FMA: ggml_cpu_has_fma), in llama.cpp's four passes over M: the scale, the dots with
// k, the update, the dots with q. (One pass doing the four row by row rounds the same but ran
// slower: a call more per row.)
#pragma once

#include <cmath>
#include <cstring>
#include <vector>

#include "ggml-cpu.h"
#include "openvino/core/parallel.hpp"
#include "openvino/op/op.hpp"

namespace kafila {

// y ← y + x·v, as ggml's vec_mad_f32 rounds it: fused multiply-add where ggml's build has FMA
__attribute__((target("avx2,fma"))) inline void mad_fused(float* y, const float* x, float v, size_t n) {
    for (size_t i = 0; i < n; ++i) y[i] = __builtin_fmaf(x[i], v, y[i]);
}

inline void mad_rounded(float* y, const float* x, float v, size_t n) {
    for (size_t i = 0; i < n; ++i) y[i] += x[i] * v;
}

inline bool ggml_fuses_mad() {
    static const bool fused = ggml_cpu_has_fma() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return fused;
}

class KafilaDeltaRule : public ov::op::Op {
public:
    OPENVINO_OP("KafilaDeltaRule", "kafila");

    KafilaDeltaRule() = default;
    // q, k, v [B, L, H, S]; g, beta [B, L, H]; m0 [B, H, S, S] → o [B, L, H, S], m [B, H, S, S]
    explicit KafilaDeltaRule(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }

    void validate_and_infer_types() override {
        NODE_VALIDATION_CHECK(this, get_input_size() == 6, "q, k, v, g, beta, m0");
        for (size_t i = 0; i < 6; ++i) {
            NODE_VALIDATION_CHECK(this, get_input_element_type(i) == ov::element::f32, "input ", i, " must be f32");
        }
        const auto& q = get_input_partial_shape(0);
        const auto& m = get_input_partial_shape(5);
        NODE_VALIDATION_CHECK(this, q.rank().compatible(4) && m.rank().compatible(4), "q [B, L, H, S], m0 [B, H, S, S]");
        set_output_type(0, ov::element::f32, q);
        set_output_type(1, ov::element::f32, m);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        check_new_args_count(this, args);
        return std::make_shared<KafilaDeltaRule>(args);
    }

    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const ov::Shape qs = inputs[0].get_shape(), ms = inputs[5].get_shape();
        bool fits = qs.size() == 4 && ms.size() == 4;
        if (fits) {
            const ov::Shape gs = {qs[0], qs[1], qs[2]};
            fits = ms[0] == qs[0] && ms[1] == qs[2] && ms[2] == qs[3] && ms[3] == qs[3] &&
                   inputs[1].get_shape() == qs && inputs[2].get_shape() == qs && inputs[3].get_shape() == gs &&
                   inputs[4].get_shape() == gs;
        }
        OPENVINO_ASSERT(fits, "KafilaDeltaRule: q ", qs, " and m0 ", ms, " do not fit");
        const size_t B = qs[0], L = qs[1], H = qs[2], S = qs[3];
        outputs[0].set_shape(qs);
        outputs[1].set_shape(ms);
        const float* q = inputs[0].data<const float>();
        const float* k = inputs[1].data<const float>();
        const float* v = inputs[2].data<const float>();
        const float* g = inputs[3].data<const float>();
        const float* beta = inputs[4].data<const float>();
        const float* m0 = inputs[5].data<const float>();
        float* o = outputs[0].data<float>();
        float* m_out = outputs[1].data<float>();
        // ggml's own f32 dot product (SIMD for this CPU), as llama.cpp's op uses
        const ggml_vec_dot_t dot = ggml_get_type_traits_cpu(GGML_TYPE_F32)->vec_dot;
        const int n = static_cast<int>(S);
        const auto mad = ggml_fuses_mad() ? mad_fused : mad_rounded;
        const float scale = 1.0f / std::sqrt(static_cast<float>(S));
        ov::parallel_for(B * H, [&](size_t bh) {
            const size_t b = bh / H, h = bh % H;
            float* M = m_out + bh * S * S;
            std::memcpy(M, m0 + bh * S * S, S * S * sizeof(float));
            std::vector<float> d(S);
            for (size_t t = 0; t < L; ++t) {
                const size_t row = (b * L + t) * H + h;  // [B, L, H]
                const float* kt = k + row * S;
                const float* qt = q + row * S;
                const float* vt = v + row * S;
                float* ot = o + row * S;
                const float decay = std::exp(g[row]), bt = beta[row];
                for (size_t i = 0; i < S * S; ++i) M[i] *= decay;
                for (size_t j = 0; j < S; ++j) {  // row j of M: value j
                    float sum = 0.0f;
                    dot(n, &sum, 0, M + j * S, 0, kt, 0, 1);
                    d[j] = (vt[j] - sum) * bt;
                }
                for (size_t j = 0; j < S; ++j) mad(M + j * S, kt, d[j], S);
                for (size_t j = 0; j < S; ++j) {
                    float sum = 0.0f;
                    dot(n, &sum, 0, M + j * S, 0, qt, 0, 1);
                    ot[j] = sum * scale;
                }
            }
        });
        return true;
    }
};

}  // namespace kafila
