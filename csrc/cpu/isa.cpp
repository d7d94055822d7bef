// Run-time ISA detection and override (see isa.h), the kernel table of the ISA in use, and their Python bindings.
#include "isa.h"

#include <torch/extension.h>

#include <atomic>
#include <cstdlib>

#include "isa_list.h"
#include "kernel_table.h"
#include "kernels.h"

namespace kivi::cpu {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_isa{kUnset};
std::atomic<int> g_dot{kUnset};

#define KIVI_ISA_ENUMERATOR(enumerator, name) Isa::enumerator,
constexpr Isa kBestFirst[] = {KIVI_CPU_ISAS(KIVI_ISA_ENUMERATOR)};
#undef KIVI_ISA_ENUMERATOR

// Indexed by Isa: the one place the ISA picks its kernels.
#define KIVI_ISA_TABLE(enumerator, name) &KIVI_KERNELS_OF(name),
const KernelTable* const kTables[] = {KIVI_CPU_ISAS(KIVI_ISA_TABLE)};
#undef KIVI_ISA_TABLE

Isa best_isa() {
  for (Isa isa : kBestFirst) {
    if (isa_supported(isa)) return isa;
  }
  return kBestFirst[sizeof(kBestFirst) / sizeof(kBestFirst[0]) - 1];
}

Isa isa_from_environment() {
  const char* requested = std::getenv("KIVI_XPU_CPU_ISA");
  if (requested == nullptr || *requested == '\0') return best_isa();
  const Isa isa = parse_isa(requested);
  TORCH_CHECK_VALUE(isa_supported(isa), "KIVI_XPU_CPU_ISA=", requested, " but this CPU lacks ", isa_name(isa),
                    "; available: ", c10::Join(", ", available_isas()));
  return isa;
}

}  // namespace

bool isa_supported(Isa isa) {
  __builtin_cpu_init();
#define KIVI_CPU_HAS(feature) &&__builtin_cpu_supports(#feature)
#define KIVI_ISA_SUPPORTED(enumerator, name) \
  case Isa::enumerator:                      \
    return true KIVI_FEATURES_##name(KIVI_CPU_HAS);
  switch (isa) { KIVI_CPU_ISAS(KIVI_ISA_SUPPORTED) }
#undef KIVI_ISA_SUPPORTED
#undef KIVI_CPU_HAS
  return false;
}

const char* isa_name(Isa isa) {
#define KIVI_ISA_NAME(enumerator, name) \
  case Isa::enumerator:                 \
    return #name;
  switch (isa) { KIVI_CPU_ISAS(KIVI_ISA_NAME) }
#undef KIVI_ISA_NAME
  return "unknown";
}

Isa parse_isa(const std::string& name) {
  std::vector<std::string> names;
  for (Isa isa : kBestFirst) {
    if (name == isa_name(isa)) return isa;
    names.emplace_back(isa_name(isa));
  }
  TORCH_CHECK_VALUE(false, "unknown CPU ISA '", name, "': expected one of ", c10::Join(", ", names));
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (Isa isa : kBestFirst) {
    if (isa_supported(isa)) names.emplace_back(isa_name(isa));
  }
  return names;
}

Isa current_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa == kUnset) {
    isa = static_cast<int>(isa_from_environment());
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return static_cast<Isa>(isa);
}

void set_isa(Isa isa) {
  TORCH_CHECK_VALUE(isa_supported(isa), "this CPU lacks ", isa_name(isa), "; available: ",
                    c10::Join(", ", available_isas()));
  g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

const KernelTable& kernels() { return *kTables[static_cast<int>(current_isa())]; }

const char* dot_name(Dot dot) { return dot == Dot::kInt8 ? "int8" : "fp32"; }

Dot parse_dot(const std::string& name) {
  for (Dot dot : {Dot::kInt8, Dot::kFp32}) {
    if (name == dot_name(dot)) return dot;
  }
  TORCH_CHECK_VALUE(false, "unknown decode attention arithmetic '", name, "': expected one of int8, fp32");
}

Dot current_dot() {
  int dot = g_dot.load(std::memory_order_relaxed);
  if (dot == kUnset) {
    const char* requested = std::getenv("KIVI_XPU_CPU_DOT");
    const std::string name = requested == nullptr ? "" : requested;
    TORCH_CHECK_VALUE(name.empty() || name == "int8" || name == "fp32", "KIVI_XPU_CPU_DOT=", name,
                      " is not an arithmetic of the decode attention: expected one of int8, fp32");
    dot = static_cast<int>(name.empty() ? Dot::kInt8 : parse_dot(name));
    g_dot.store(dot, std::memory_order_relaxed);
  }
  return static_cast<Dot>(dot);
}

void set_dot(Dot dot) { g_dot.store(static_cast<int>(dot), std::memory_order_relaxed); }

void register_isa(pybind11::module& m) {
  m.def(
      "isa", [] { return std::string(isa_name(current_isa())); },
      "The SIMD instruction set the native kernels use: one of available_isas(), e.g. 'avx2'.");
  m.def("available_isas", &available_isas, "The instruction sets this CPU supports, best first.");
  m.def(
      "set_isa", [](const std::string& name) { set_isa(parse_isa(name)); },
      "Forces the instruction set of every later call (tests; KIVI_XPU_CPU_ISA sets it for a whole process).");
  m.def(
      "dot", [] { return std::string(dot_name(current_dot())); },
      "The decode attention's arithmetic on packed 2/4-bit codes: 'int8' (integer dot products; not on the baseline "
      "ISA) or 'fp32'.");
  m.def(
      "set_dot", [](const std::string& name) { set_dot(parse_dot(name)); },
      "Sets the arithmetic of every later decode attention call (KIVI_XPU_CPU_DOT sets it for a whole process).");
}

}  // namespace kivi::cpu
