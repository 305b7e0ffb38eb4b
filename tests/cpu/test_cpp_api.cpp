// The C++ header over the C API: same results, errors become sage::Exception with the message.
#include <gtest/gtest.h>

#include <vector>

#include "common/test_util.h"
#include "sage/sage.hpp"

namespace {

TEST(CppApi, RunsAndThrowsWithTheLibraryMessage) {
  std::mt19937_64 rng(sage::test::fresh_seed());
  const auto q = sage::test::random_tensor(rng, 1, 2, 33, 64);
  const auto k = sage::test::random_tensor(rng, 1, 1, 40, 64, 3.0f);
  const auto v = sage::test::random_tensor(rng, 1, 1, 40, 64);
  std::vector<uint16_t> o(2 * 33 * 64, 0xFFFF), o_c(o.size(), 0xFFFF);
  std::vector<float> lse(2 * 33);
  sage::AttentionArgs a;
  a.tensors(q.data.data(), k.data.data(), v.data.data(), o.data())
      .shape(1, 2, 1, 33, 40, 64)
      .with_mask(SAGE_MASK_CAUSAL_BOTTOM_RIGHT)
      .with_lse(lse.data())
      .with_variant(SAGE_VARIANT_SAGE2_4B);
  sage::attention(a);
  EXPECT_EQ(sage::workspace_size(a), 0u);
  // The same through the C API.
  sage_attention_args c;
  sage_attention_args_init(&c);
  c.q = q.data.data(), c.k = k.data.data(), c.v = v.data.data(), c.o = o_c.data();
  c.batch = 1, c.heads_q = 2, c.heads_kv = 1, c.seq_q = 33, c.seq_kv = 40, c.head_dim = 64;
  c.mask = SAGE_MASK_CAUSAL_BOTTOM_RIGHT;
  c.variant = SAGE_VARIANT_SAGE2_4B;
  ASSERT_EQ(sage_attention(&c), SAGE_OK);
  EXPECT_EQ(o, o_c);
  // Errors: GQA ratio.
  a.heads_kv = 3;
  try {
    sage::attention(a);
    FAIL() << "no exception";
  } catch (const sage::Exception& e) {
    EXPECT_EQ(e.status(), SAGE_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("heads_kv"), std::string::npos) << e.what();
  }
  EXPECT_EQ(sage::quant_preset(SAGE_VARIANT_SAGE2_4B).qk_format, SAGE_QK_INT4);
  EXPECT_EQ(sage::version(), sage_version());
}

}  // namespace
