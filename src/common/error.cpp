// Thread-local last-error storage behind sage_last_error(). Host code; any architecture.
#include "common/error.h"

#include <cstdarg>
#include <cstdio>

namespace sage {
namespace {
thread_local std::string t_last_error;
}

sage_status set_error(sage_status status, const char* format, ...) {
  char buffer[1024];
  va_list ap;
  va_start(ap, format);
  std::vsnprintf(buffer, sizeof(buffer), format, ap);
  va_end(ap);
  t_last_error = buffer;
  return status;
}

void clear_error() { t_last_error.clear(); }

const char* last_error() { return t_last_error.c_str(); }

}  // namespace sage
