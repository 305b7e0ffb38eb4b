// The paper's ablations (003 Tables 4, 6, 7; the FP22 study of §3.4), the two kernel variants and
// the SageAttention3 paper's FP4 Table 1, as quantization configs: what `sage accuracy` prints and
// what the ordering tests check.
#pragma once

#include <string>
#include <vector>

#include "sage/sage.h"

namespace sage::ref {

struct AblationRow {
  std::string table;  // e.g. "smoothing (INT4 Q,K; paper Table 4)"
  std::string label;  // e.g. "Q+K"
  sage_quant_config cfg;
};

std::vector<AblationRow> paper_ablations();

}  // namespace sage::ref
