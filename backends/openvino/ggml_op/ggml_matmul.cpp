// GgmlMatMul: y[..., rows] = x[..., cols] · W[rows, cols]ᵀ for W in a GGUF block type, computed by
// ggml's own CPU kernels (llama-cpp-python's libggml-cpu): each row of x is quantized to the type's
// vec_dot type by ggml's from_float (Q8_K for the K-quants, Q8_0 for Q4_0/Q8_0), then every weight
// row's dot product is ggml's vec_dot for that type on the file's own bytes, which is the arithmetic
// llama.cpp's mul_mat runs on a CPU. The CPU plugin has no kernel for this op, so it calls
// evaluate() once per inference on one thread with the tensors in place; the rows are divided
// over the plugin's own thread pool here (ov::parallel_for).
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "ggml.h"
#include "ggml-cpu.h"
#include "openvino/core/extension.hpp"
#include "openvino/core/op_extension.hpp"
#include "openvino/core/parallel.hpp"
#include "openvino/op/op.hpp"

namespace kafila {

class GgmlMatMul : public ov::op::Op {
public:
    OPENVINO_OP("GgmlMatMul", "kafila");

    GgmlMatMul() = default;
    GgmlMatMul(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& w, int64_t type, int64_t rows, int64_t cols)
        : Op({x, w}), m_type(type), m_rows(rows), m_cols(cols) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        const auto traits = type_traits();
        NODE_VALIDATION_CHECK(this, traits != nullptr && traits->vec_dot != nullptr,
                              "ggml type ", m_type, " has no CPU dot product");
        NODE_VALIDATION_CHECK(this, m_cols % ggml_blck_size(static_cast<ggml_type>(m_type)) == 0,
                              "cols ", m_cols, " is not a whole number of blocks");
        NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "x must be f32");
        NODE_VALIDATION_CHECK(this, get_input_element_type(1) == ov::element::u8, "weights must be u8 bytes");
        const auto& w = get_input_partial_shape(1);
        NODE_VALIDATION_CHECK(this, w.is_static() && ov::shape_size(w.to_shape()) == m_rows * row_bytes(),
                              "weights hold ", w, " bytes, not ", m_rows, " rows of ", row_bytes());
        auto shape = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, shape.rank().is_static() && shape.rank().get_length() >= 1, "x needs a rank");
        const auto last = shape.rank().get_length() - 1;
        NODE_VALIDATION_CHECK(this, shape[last].compatible(m_cols), "x's last dimension ", shape[last], " is not ", m_cols);
        shape[last] = m_rows;
        set_output_type(0, ov::element::f32, shape);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        check_new_args_count(this, args);
        return std::make_shared<GgmlMatMul>(args.at(0), args.at(1), m_type, m_rows, m_cols);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("type", m_type);
        visitor.on_attribute("rows", m_rows);
        visitor.on_attribute("cols", m_cols);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto* traits = type_traits();
        const auto act_type = traits->vec_dot_type;
        const auto* act = ggml_get_type_traits_cpu(act_type);
        ov::Shape shape = inputs[0].get_shape();
        const size_t n_x = ov::shape_size(shape) / m_cols;
        shape.back() = m_rows;
        outputs[0].set_shape(shape);
        const float* x = inputs[0].data<const float>();
        const auto* w = static_cast<const uint8_t*>(inputs[1].data());
        float* y = outputs[0].data<float>();
        const size_t w_bytes = row_bytes();
        const size_t q_bytes = ggml_row_size(act_type, m_cols);
        // The activations in the dot product's type: as llama.cpp quantizes src1 (from_float, or a
        // copy where the vec_dot type is f32 itself).
        // (A thread_local buffer named inside the lambdas below would be each worker's own: take
        // its address here, on the calling thread.)
        thread_local std::vector<uint8_t> buffer;
        buffer.resize(n_x * q_bytes);
        uint8_t* const quantized = buffer.data();
        ov::parallel_for(n_x, [&](size_t i) {
            if (act->from_float != nullptr) {
                act->from_float(x + i * m_cols, quantized + i * q_bytes, m_cols);
            } else {
                std::memcpy(quantized + i * q_bytes, x + i * m_cols, q_bytes);
            }
        });
        // Tiles of kRowTile weight rows × kXTile rows of x, so both stay in cache while every
        // pair's dot product runs (prefill and batched rows read each weight row once per tile).
        constexpr size_t kRowTile = 32, kXTile = 16;
        const size_t tasks = (m_rows + kRowTile - 1) / kRowTile;
        const uint8_t* q = quantized;
        ov::parallel_for(tasks, [&](size_t t) {
            const size_t r0 = t * kRowTile, r1 = std::min<size_t>(m_rows, r0 + kRowTile);
            for (size_t i0 = 0; i0 < n_x; i0 += kXTile) {
                const size_t i1 = std::min(n_x, i0 + kXTile);
                for (size_t r = r0; r < r1; ++r) {
                    const uint8_t* wr = w + r * w_bytes;
                    for (size_t i = i0; i < i1; ++i) {
                        traits->vec_dot(static_cast<int>(m_cols), y + i * m_rows + r, 0, wr, 0, q + i * q_bytes, 0, 1);
                    }
                }
            }
        });
        return true;
    }

private:
    const ggml_type_traits_cpu* type_traits() const {
        static const bool ready = (ggml_cpu_init(), true);  // ggml's f16 tables, once per process
        (void)ready;
        if (m_type < 0 || m_type >= GGML_TYPE_COUNT) return nullptr;
        return ggml_get_type_traits_cpu(static_cast<ggml_type>(m_type));
    }
    size_t row_bytes() const { return ggml_row_size(static_cast<ggml_type>(m_type), m_cols); }

    int64_t m_type = 0;
    int64_t m_rows = 0;
    int64_t m_cols = 0;
};

}  // namespace kafila

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<kafila::GgmlMatMul>>()}));
