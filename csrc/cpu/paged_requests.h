// The columns of paged_decode_attention's `requests` table [N, kRequestColumns] int64, one row per request. The one
// C++ place that names them: kivi_xpu/ops/checks.py (PAGED_REQUEST_COLUMNS) lists the same names in the same order.
// No includes and no code: any C++ file (the native or the SYCL host side) can include it.
#pragma once

namespace kivi::paged {

enum RequestColumn : int {
  kSlot,          // the request's slot in the exact windows
  kSinks,         // exact sink tokens at the start of its slot
  kKeyCount,      // packed key tokens (whole pages)
  kKeyTailRow,    // window row of its first exact key tail token
  kValueCount,    // packed value tokens
  kValueTailRow,  // window row of its first exact value tail token
  kLength,        // positions in all: sinks + packed + tail, for keys and for values
  kRequestColumns
};

}  // namespace kivi::paged
