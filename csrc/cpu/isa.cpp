// Run-time ISA detection and override (see isa.h), and its Python bindings.
#include "isa.h"

#include <torch/extension.h>

#include <atomic>
#include <cstdlib>

#include "kernels.h"

namespace kivi::cpu {
namespace {

constexpr int kUnset = -1;
constexpr Isa kBestFirst[] = {Isa::kAvx512Vnni, Isa::kAvx512, Isa::kAvx2, Isa::kBaseline};
std::atomic<int> g_isa{kUnset};
std::atomic<int> g_dot{kUnset};

Isa best_isa() {
  for (Isa isa : kBestFirst) {
    if (isa_supported(isa)) return isa;
  }
  return Isa::kBaseline;
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
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case Isa::kAvx512Vnni:
      return avx512 && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvx512:
      return avx512;
    case Isa::kAvx2:
      return avx2;
    case Isa::kBaseline:
      return true;
  }
  return false;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni:
      return "avx512_vnni";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kBaseline:
      return "baseline";
  }
  return "unknown";
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : kBestFirst) {
    if (name == isa_name(isa)) return isa;
  }
  TORCH_CHECK_VALUE(false, "unknown CPU ISA '", name, "': expected one of avx512_vnni, avx512, avx2, baseline");
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
      "The SIMD instruction set the native kernels use: 'avx512_vnni', 'avx512', 'avx2' or 'baseline'.");
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
