// dtype.cpp: the conversions are inline in dtype.hpp; this unit checks at compile time that
// the header stands alone.
#include "zp/runtime/dtype.hpp"

static_assert(zp::runtime::dtype_bytes(zp::runtime::DType::bf16) == 2);
