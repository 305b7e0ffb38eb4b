// Errors are values: every C API function returns a sage_status and leaves a thread-local message
// (naming the argument and its value) for sage_last_error(). Host code only; any architecture.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "sage/sage.h"

namespace sage {

// Records `message` as this thread's last error and returns `status` (so callers can
// `return set_error(...)`). printf-style.
sage_status set_error(sage_status status, const char* format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void clear_error();
const char* last_error();

// Thrown inside the CPU reference (e.g. allocation failure) and turned into a status at the API
// boundary; never crosses the C ABI.
struct Error {
  sage_status status;
  std::string message;
};

// The integer a C caller stored in an enum field. Reading a C++ enum outside its declared range
// is undefined behaviour (and -fstrict-enums lets the compiler drop range checks), so every
// validation reads the raw bits of the field.
template <typename E>
int64_t enum_value(const E& e) {
  static_assert(sizeof(E) == sizeof(int32_t), "C enums are int-sized");
  int32_t raw;
  std::memcpy(&raw, &e, sizeof(raw));
  return raw;
}

}  // namespace sage

// Return the status of a sage_status-returning expression if it is not SAGE_OK.
#define SAGE_RETURN_IF_ERROR(expr)                    \
  do {                                                \
    const sage_status sage_status_ = (expr);          \
    if (sage_status_ != SAGE_OK) return sage_status_; \
  } while (0)

// Validation helper: if `cond` is false, record an invalid-argument error and return it.
#define SAGE_CHECK_ARG(cond, ...)                                                    \
  do {                                                                               \
    if (!(cond)) return ::sage::set_error(SAGE_ERROR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)
