#include <gtest/gtest.h>
#include "sage/sage.h"
TEST(Smoke, Version) { EXPECT_STREQ(sage_version(), "0.1.0"); }
