// The float dtypes the native kernels read and write (data, metadata, outputs), shared by the dispatchers and the
// per-ISA kernels. No torch types, so the ISA translation units can include it inside their `#pragma GCC target`.
#pragma once

namespace kivi::cpu {

enum Dtype : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

}  // namespace kivi::cpu
