// libsage.so: the C API of sage_core, linked whole; this file only anchors the shared library.
#include "sage/sage.h"
