// CPU kernels: ATen's parallel_for (respects torch.set_num_threads; OpenMP, so the build needs
// -fopenmp) over blocks of elements or rows, at::vec::Vectorized arithmetic, fp32 accumulation (fp64
// for fp64). Half and bfloat16 are widened to fp32 in registers where the kernel has a vector path,
// else staged through a small fp32 buffer (the portable code / fp64 paths of the codes kernels).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#include <limits>
#include <mutex>
#include <new>
#include <array>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "lowmem_kernels.h"
#include "lowmem_math.h"

namespace lowmem {

const c10::DeviceType kKernelDevice = c10::DeviceType::CPU;

namespace {

using at::vec::Vectorized;

// Allocates on 64-byte boundaries (a cache line; ATen's own allocations are so aligned): a std::vector's 16
// bytes split a vector load in two across cache lines on every other 32-byte load.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, kAlignment); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};

// Per-call scratch values the kernels read by vector loads (per-column values, a row's working copy): cache-line
// aligned. Allocated by std::vector's 16-byte alignment, the frozen norm's backward ran at 1.07-1.19x ATen's
// time (AVX2, 768 fp32 columns) where it ran at 0.94-1.03x with its values 64-byte aligned.
template <typename T>
using Scratch = std::vector<T, CacheLineAllocator<T>>;

// Elements of T as acc_t: the data itself when the types agree, else a converted copy in buf.
template <typename T, typename acc_t>
const acc_t* as_acc(const T* src, acc_t* buf, int64_t n) {
  if constexpr (std::is_same_v<T, acc_t>) {
    return src;
  } else {
    at::vec::convert(src, buf, n);
    return buf;
  }
}

template <typename acc_t>
acc_t load(const acc_t* p, int64_t i, acc_t) { return p[i]; }
template <typename acc_t>
Vectorized<acc_t> load(const acc_t* p, int64_t i, Vectorized<acc_t>) { return Vectorized<acc_t>::loadu(p + i); }
template <typename acc_t>
void store(acc_t* p, int64_t i, acc_t v) { p[i] = v; }
template <typename acc_t>
void store(acc_t* p, int64_t i, Vectorized<acc_t> v) { v.store(p + i); }

// Calls f(i, V{}) over [0, n): V is Vectorized<acc_t> in the body, acc_t in the tail.
template <typename acc_t, typename F>
void row_for_each(int64_t n, F&& f) {
  using Vec = Vectorized<acc_t>;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) f(i, Vec());
  for (; i < n; ++i) f(i, acc_t());
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The levels of Vectorized<float>::size() consecutive codes (their packed bits start on a byte boundary)
// as one vector, in registers: the codes' word broadcast to every lane, shifted by the lane's bit offset,
// masked, then a lane permute of the level table (at most 16 levels; AVX2 blends two 8-lane halves).
template <int kBits>
class VecLevels {
 public:
  static constexpr int W = Vectorized<float>::size();
  static constexpr int kBytes = W * kBits / 8;  // packed bytes per vector of codes

  explicit VecLevels(const float* levels) {
    alignas(64) float table[16] = {};
    alignas(64) int32_t shift[W], word[W];
    for (int k = 0; k < Packing<kBits>::kLevels; ++k) table[k] = levels[k];
    for (int lane = 0; lane < W; ++lane) {
      shift[lane] = lane * kBits % 32;
      word[lane] = lane * kBits / 32;
    }
#if defined(CPU_CAPABILITY_AVX512)
    table_ = _mm512_load_ps(table);
    shift_ = _mm512_load_si512(shift);
    word_ = _mm512_load_si512(word);
    mask_ = _mm512_set1_epi32(Packing<kBits>::kMask);
#else
    low_ = _mm256_load_ps(table);
    high_ = _mm256_load_ps(table + 8);
    shift_ = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift));
    mask_ = _mm256_set1_epi32(Packing<kBits>::kMask);
#endif
  }

  Vectorized<float> operator()(const uint8_t* packed) const {
    uint64_t bits = 0;
    std::memcpy(&bits, packed, kBytes);
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i words = _mm512_permutexvar_epi32(word_, _mm512_castsi128_si512(_mm_cvtsi64_si128(bits)));
    return _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(words, shift_), mask_), table_);
#else
    const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(bits)), shift_), mask_);
    const __m256 low = _mm256_permutevar8x32_ps(low_, code);
    if constexpr (kBits < 4) return low;
    const __m256 above_7 = _mm256_castsi256_ps(_mm256_slli_epi32(code, 28));  // bit 3 of the code, as a sign
    return _mm256_blendv_ps(low, _mm256_permutevar8x32_ps(high_, code), above_7);
#endif
  }

 private:
#if defined(CPU_CAPABILITY_AVX512)
  __m512 table_;
  __m512i shift_, word_, mask_;
#else
  __m256 low_, high_;
  __m256i shift_, mask_;
#endif
};

// The packed codes of Vectorized<float>::size() elements (W * kBits bits, element e at bit e * kBits):
// a lane's code is how many thresholds it exceeds. One bit: the compare mask is the packed codes. Two
// bits: the three compare masks counted. Four bits: a binary search of the ascending thresholds, four
// compares with a threshold looked up per lane, not fifteen (4-bit SiLU fp32 fwd+bwd 1.13-1.2x stock's
// against 1.23-1.3x counting, AMD EPYC). AVX512: codes narrowed to bytes, then packed as pack_word does
// (four bits: pairs ORed in 64-bit lanes, then narrowed once); AVX2: each lane shifted to its bit offset,
// the lanes ORed into one word.
template <int kBits>
class VecCodes {
 public:
  static constexpr int W = Vectorized<float>::size();
  static constexpr int kBytes = W * kBits / 8;

  explicit VecCodes(const float* thresholds) {
    for (int t = 0; t < Packing<kBits>::kThresholds; ++t) thresholds_[t] = Vectorized<float>(thresholds[t]);
    if constexpr (kBits == 4) {
      for (int k = 0; k < 3; ++k) {  // step 4 >> k of the search: each lane's threshold by the count so far
        alignas(64) float probe[16];
#if defined(CPU_CAPABILITY_AVX512)
        for (int count = 0; count < 16; ++count) probe[count] = thresholds[std::min(count + (4 >> k) - 1, 14)];
        probes_[k] = _mm512_load_ps(probe);
#else
        for (int h = 0; h < 8; ++h) probe[h] = thresholds[std::min(2 * h + (4 >> k) - 1, 14)];  // count 2h
        probes_[k] = _mm256_load_ps(probe);
#endif
      }
    }
#if !defined(CPU_CAPABILITY_AVX512)
    alignas(32) int32_t shift[W];
    for (int lane = 0; lane < W; ++lane) shift[lane] = lane * kBits % 32;
    shift_ = _mm256_load_si256(reinterpret_cast<const __m256i*>(shift));
#endif
  }

  void operator()(Vectorized<float> x, uint8_t* packed) const {
    uint64_t bits;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (kBits == 1) {
      bits = _mm512_cmp_ps_mask(x, thresholds_[0], _CMP_GT_OQ);
    } else {
      __m512i count = _mm512_setzero_si512();
      if constexpr (kBits == 4) {  // steps 8 (threshold 7 for every lane), 4, 2, 1
        count = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, thresholds_[7], _CMP_GT_OQ), _mm512_set1_epi32(8));
        for (int k = 0; k < 3; ++k) {
          const __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(count, probes_[k]), _CMP_GT_OQ);
          count = _mm512_mask_add_epi32(count, above, count, _mm512_set1_epi32(4 >> k));
        }
      } else {
        for (int t = 0; t < Packing<kBits>::kThresholds; ++t) {
          count = _mm512_mask_add_epi32(count, _mm512_cmp_ps_mask(x, thresholds_[t], _CMP_GT_OQ), count,
                                        _mm512_set1_epi32(1));
        }
      }
      if constexpr (kBits == 2) {  // one code per byte, then each word of 4 bytes packed into its low byte
        const __m128i codes = _mm512_cvtepi32_epi8(count);
        __m128i word = _mm_or_si128(codes, _mm_srli_epi32(codes, 6));
        word = _mm_or_si128(word, _mm_srli_epi32(word, 12));
        bits = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_cvtepi32_epi8(word)));
      } else {  // each 64-bit lane's two codes into its low byte, then those bytes (one narrowing, not two)
        const __m512i pairs = _mm512_or_si512(count, _mm512_srli_epi64(count, 28));
        bits = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm512_cvtepi64_epi8(pairs)));
      }
    }
#else
    if constexpr (kBits == 1) {
      bits = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x, thresholds_[0], _CMP_GT_OQ)));
    } else {
      __m256i count = _mm256_setzero_si256();
      if constexpr (kBits == 4) {  // steps 8 (threshold 7 for every lane), 4, 2, 1
        // h: the code's top three bits (count = 2h before the last step), so that every probe is an 8-lane
        // table indexed by h: one permute a step, not two and a blend for a 16-lane table indexed by count
        // (the codes alone took 0.66x F.silu's time instead of 0.9x, AVX2 code on AMD EPYC)
        __m256i h = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(x, thresholds_[7], _CMP_GT_OQ)),
                                     _mm256_set1_epi32(4));
        for (int k = 0; k < 2; ++k) {
          const __m256i above =
              _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_permutevar8x32_ps(probes_[k], h), _CMP_GT_OQ));
          h = _mm256_add_epi32(h, _mm256_and_si256(above, _mm256_set1_epi32(2 >> k)));
        }
        const __m256i above =
            _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_permutevar8x32_ps(probes_[2], h), _CMP_GT_OQ));
        count = _mm256_sub_epi32(_mm256_add_epi32(h, h), above);  // 2h + 1 where above (all ones: -1)
      } else {
        for (int t = 0; t < Packing<kBits>::kThresholds; ++t) {  // minus the all-ones compare masks
          count = _mm256_sub_epi32(count, _mm256_castps_si256(_mm256_cmp_ps(x, thresholds_[t], _CMP_GT_OQ)));
        }
      }
      const __m256i placed = _mm256_sllv_epi32(count, shift_);
      __m128i word = _mm_or_si128(_mm256_castsi256_si128(placed), _mm256_extracti128_si256(placed, 1));
      word = _mm_or_si128(word, _mm_shuffle_epi32(word, 0x4E));
      word = _mm_or_si128(word, _mm_shuffle_epi32(word, 0xB1));
      bits = static_cast<uint32_t>(_mm_cvtsi128_si32(word));
    }
#endif
    std::memcpy(packed, &bits, kBytes);
  }

 private:
  Vectorized<float> thresholds_[Packing<kBits>::kThresholds];
#if defined(CPU_CAPABILITY_AVX512)
  __m512 probes_[3];  // 4 bits: the thresholds each lane compares with at steps 4, 2 and 1 of the search
#else
  __m256 probes_[3];
  __m256i shift_;
#endif
};

// Packed codes of x[from, last) straight from registers; `from` is a multiple of the vector length (so of
// the codes per byte), the last range has the tail: a partial last byte padded with zero codes.
template <int kBits, typename T>
void codes_range(const T* x, int64_t from, int64_t last, const VecCodes<kBits>& codes_of, const float* thresholds,
                 uint8_t* packed) {
  using fVec = Vectorized<float>;
  constexpr int64_t kStep = std::is_same_v<T, float> ? fVec::size() : 2 * fVec::size();
  constexpr int P = Packing<kBits>::kPerByte;
  const auto byte_of = [&](int64_t i) { return packed + i * kBits / 8; };
  int64_t i = from;
  for (; i + kStep <= last; i += kStep) {
    if constexpr (std::is_same_v<T, float>) {
      codes_of(fVec::loadu(x + i), byte_of(i));
    } else {
      auto [x0, x1] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(x + i));
      codes_of(x0, byte_of(i));
      codes_of(x1, byte_of(i + fVec::size()));
    }
  }
  for (int64_t j = i / P; j * P < last; ++j) {
    uint8_t byte = 0;
    for (int slot = 0; slot < P && j * P + slot < last; ++slot) {
      byte |= static_cast<uint8_t>(step_code<kBits>(static_cast<float>(x[j * P + slot]), thresholds) << (kBits * slot));
    }
    packed[j] = byte;
  }
}

// Packed codes of float, half and bfloat16 elements in one pass over x. Tasks cover whole vectors of T.
template <int kBits, typename T>
void act_codes_vectorized(const T* x, int64_t numel, const float* thresholds, uint8_t* packed) {
  constexpr int64_t kStep = std::is_same_v<T, float> ? Vectorized<float>::size() : 2 * Vectorized<float>::size();
  at::parallel_for(0, (numel + kStep - 1) / kStep, 4096 / kStep, [&](int64_t begin, int64_t end) {
    const VecCodes<kBits> codes_of(thresholds);  // a task's own: the byte stores cannot alias it
    codes_range<kBits>(x, begin * kStep, std::min(numel, end * kStep), codes_of, thresholds, packed);
  });
}

// F.silu(x) of fp32 x, bit for bit, and its codes in one pass over x. The output repeats ATen's own SiLU
// kernel exactly: the same tasks (parallel_for over the elements with ATen's grain), in each the same
// expression on pairs of vectors and std::exp on the task's tail. A task whose bounds are multiples of 64
// elements (whole bytes and words of codes) packs the codes of each pair in the SiLU's own loop: their
// compares then overlap the loop's memory traffic (a pass of its own over x in cache cost 12-20% more,
// AMD EPYC). Other tasks pack by blocks that follow the SiLU while x is in cache, over ranges cut at
// multiples of 64 elements so that no two tasks share a byte.
template <int kBits>
void silu_codes_kernel(const float* x, int64_t numel, const float* thresholds, float* y, uint8_t* packed) {
  using Vec = Vectorized<float>;
  constexpr int64_t kPair = 2 * Vec::size(), kBlock = 8192;
  const Vec one(1.0f);
  const auto byte_of = [&](int64_t i) { return packed + i * kBits / 8; };
  at::parallel_for(0, numel, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
    const VecCodes<kBits> codes_of(thresholds);
    const int64_t vector_end = begin + (end - begin) / kPair * kPair;
    auto silu_until = [&, i = begin](int64_t stop, auto with_codes) mutable {
      for (; i < std::min(stop, vector_end); i += kPair) {
        const Vec x0 = Vec::loadu(x + i), x1 = Vec::loadu(x + i + Vec::size());
        (x0 / (one + x0.neg().exp())).store(y + i);
        (x1 / (one + x1.neg().exp())).store(y + i + Vec::size());
        if constexpr (decltype(with_codes)::value) {
          codes_of(x0, byte_of(i));
          codes_of(x1, byte_of(i + Vec::size()));
        }
      }
      for (; i < std::min(stop, end); ++i) y[i] = x[i] / (1.0f + std::exp(-x[i]));
    };
    if (begin % 64 == 0 && (end % 64 == 0 || end == numel)) {
      silu_until(end, std::true_type());
      codes_range<kBits>(x, vector_end, end, codes_of, thresholds, packed);
      return;
    }
    const int64_t codes_begin = begin / 64 * 64, codes_end = end == numel ? numel : end / 64 * 64;
    for (int64_t from = codes_begin; from < codes_end; from += kBlock) {
      const int64_t to = std::min(codes_end, from + kBlock);
      silu_until(to, std::false_type());
      codes_range<kBits>(x, from, to, codes_of, thresholds, packed);
    }
    silu_until(end, std::false_type());
  });
}

// out = grad * level(code) for float, half and bfloat16, levels looked up in registers (no table in memory,
// no staging): one pass as cheap as a multiply. Tasks cover whole vectors of T; the last one has the tail.
template <int kBits, typename T>
void step_scale_vectorized(const T* grad, const uint8_t* packed, int64_t numel, const float* levels, T* out) {
  using fVec = Vectorized<float>;
  constexpr int64_t kStep = std::is_same_v<T, float> ? fVec::size() : 2 * fVec::size();
  const auto byte_of = [&](int64_t i) { return packed + i * kBits / 8; };
  at::parallel_for(0, (numel + kStep - 1) / kStep, 2048 / kStep, [&](int64_t begin, int64_t end) {
    const VecLevels<kBits> level_of_codes(levels);
    const int64_t last = std::min(numel, end * kStep);
    int64_t i = begin * kStep;
    for (; i + kStep <= last; i += kStep) {
      if constexpr (std::is_same_v<T, float>) {
        (fVec::loadu(grad + i) * level_of_codes(byte_of(i))).store(out + i);
      } else {
        auto [g0, g1] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(grad + i));
        const fVec l0 = level_of_codes(byte_of(i)), l1 = level_of_codes(byte_of(i + fVec::size()));
        at::vec::convert_from_float<T>(g0 * l0, g1 * l1).store(out + i);
      }
    }
    for (; i < last; ++i) {
      out[i] = static_cast<T>(static_cast<float>(grad[i]) * levels[unpack<kBits>(packed[i / Packing<kBits>::kPerByte], i % Packing<kBits>::kPerByte)]);
    }
  });
}
#endif

// Codes of P consecutive elements, one per byte of a little-endian word (each < 2^kBits), packed into
// one byte: element s lands in bits kBits*s. Shift-or steps move byte s's code down by (8 - kBits)*s
// bits; nothing overlaps since every code fits its field. Plain integer ops, so the loop vectorizes.
template <int kBits>
inline uint8_t pack_word(const uint8_t* codes) {
  constexpr int P = Packing<kBits>::kPerByte;
  using word_t = std::conditional_t<P == 8, uint64_t, std::conditional_t<P == 4, uint32_t, uint16_t>>;
  word_t w;
  std::memcpy(&w, codes, sizeof(w));
  for (int step = 1, shift = 8 - kBits; step < P; step *= 2, shift *= 2) w |= w >> shift;
  return static_cast<uint8_t>(w);
}

// Packed codes of elements [first, last) of x, first a multiple of 8/kBits: bytes first/p ..
// ceil(last/p) - 1 of `packed`, a partial last byte padded with zero codes. Staged through L1-sized
// blocks (converted to fp32 when narrower): a code pass and a packing pass, both plain loops over
// __restrict arrays that the compiler vectorizes (memory-bound: as fast as reading x once).
template <int kBits, typename T>
void codes_span(const T* x, int64_t first, int64_t last, const at::opmath_type<T>* thresholds_in, uint8_t* packed) {
  using acc_t = at::opmath_type<T>;
  constexpr int P = Packing<kBits>::kPerByte;
  constexpr int64_t kBlock = 4096;
  alignas(64) std::array<acc_t, kBlock> buf;
  alignas(64) std::array<uint8_t, kBlock + 8> codes;
  acc_t thresholds[Packing<kBits>::kThresholds];  // local: the compares vectorize
  for (int t = 0; t < Packing<kBits>::kThresholds; ++t) thresholds[t] = thresholds_in[t];
  for (int64_t s = first; s < last; s += kBlock) {
    const int64_t n = std::min(kBlock, last - s);
    const acc_t* __restrict xa = as_acc(x + s, buf.data(), n);
    uint8_t* __restrict c = codes.data();
    for (int64_t i = 0; i < n; ++i) c[i] = step_code<kBits>(xa[i], thresholds);
    const int64_t bytes = (n + P - 1) / P;
    for (int64_t k = n; k < bytes * P; ++k) c[k] = 0;
    uint8_t* __restrict out = packed + s / P;
    for (int64_t j = 0; j < bytes; ++j) out[j] = pack_word<kBits>(c + P * j);
  }
}

template <int kBits, typename T>
void act_codes_kernel(const T* x, int64_t numel, const at::opmath_type<T>* thresholds, uint8_t* packed) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<at::opmath_type<T>, float>) {
    act_codes_vectorized<kBits>(x, numel, thresholds, packed);
    return;
  }
#endif
  constexpr int P = Packing<kBits>::kPerByte;
  const int64_t bytes = (numel + P - 1) / P;
  at::parallel_for(0, bytes, 2048, [&](int64_t begin, int64_t end) {
    codes_span<kBits>(x, begin * P, std::min(numel, end * P), thresholds, packed);
  });
}

// out = grad * level(code), through a table of the P levels of every byte value (8 KiB at most, in
// L1): one contiguous load of P levels per packed byte, no unpacking pass, no per-element select.
template <int kBits, typename acc_t>
struct ByteLevels {
  static constexpr int P = Packing<kBits>::kPerByte;
  alignas(64) acc_t table[256 * P];

  explicit ByteLevels(const acc_t* levels) {
    for (int byte = 0; byte < 256; ++byte) {
      for (int slot = 0; slot < P; ++slot) table[P * byte + slot] = levels[unpack<kBits>(byte, slot)];
    }
  }
};

template <int kBits, typename acc_t>
void scale_block(const acc_t* __restrict grad, const uint8_t* __restrict packed, int64_t n,
                 const ByteLevels<kBits, acc_t>& lut, acc_t* __restrict out) {
  constexpr int P = Packing<kBits>::kPerByte;
  const int64_t full = n / P;
  for (int64_t j = 0; j < full; ++j) {
    const acc_t* __restrict level = lut.table + P * packed[j];
    for (int slot = 0; slot < P; ++slot) out[P * j + slot] = grad[P * j + slot] * level[slot];
  }
  for (int64_t i = P * full; i < n; ++i) out[i] = grad[i] * lut.table[P * packed[full] + i - P * full];
}

template <int kBits, typename T>
void step_scale_kernel(const T* grad, const uint8_t* packed, int64_t numel, const double* levels_in, int64_t count,
                       T* out) {
  using acc_t = at::opmath_type<T>;
  constexpr int P = Packing<kBits>::kPerByte;
  acc_t levels[Packing<kBits>::kLevels];
  for (int k = 0; k < Packing<kBits>::kLevels; ++k) levels[k] = acc_t(levels_in[std::min<int64_t>(k, count - 1)]);
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, float>) {
    step_scale_vectorized<kBits>(grad, packed, numel, levels, out);
    return;
  }
#endif
  const ByteLevels<kBits, acc_t> lut(levels);
  const int64_t bytes = (numel + P - 1) / P;
  constexpr int64_t kBlockBytes = 4096 / P;
  at::parallel_for(0, bytes, kBlockBytes, [&](int64_t begin, int64_t end) {
    alignas(64) std::array<acc_t, 4096> buf;
    for (int64_t b0 = begin; b0 < end; b0 += kBlockBytes) {
      const int64_t nb = std::min(kBlockBytes, end - b0);
      const int64_t ne = std::min(P * nb, numel - P * b0);
      const acc_t* g = as_acc(grad + P * b0, buf.data(), ne);
      acc_t* result = std::is_same_v<T, acc_t> ? reinterpret_cast<acc_t*>(out + P * b0) : buf.data();
      scale_block<kBits>(g, packed + b0, ne, lut, result);
      if constexpr (!std::is_same_v<T, acc_t>) at::vec::convert(result, out + P * b0, ne);
    }
  });
}

// Rows per parallel task: enough elements (ATen's grain size) that a task outweighs its scheduling.
int64_t row_grain(int64_t dim) { return std::max<int64_t>(1, 32768 / dim); }

// 2 * Vectorized<acc_t>::size() elements of X as two acc_t vectors, and back: narrow types widened in
// registers (half/bfloat16 to float); other mixes (fp64 math on a float tensor) through a small array.
template <typename acc_t, typename X>
std::tuple<Vectorized<acc_t>, Vectorized<acc_t>> load_pair(const X* p) {
  using Vec = Vectorized<acc_t>;
  if constexpr (std::is_same_v<X, acc_t>) {
    return {Vec::loadu(p), Vec::loadu(p + Vec::size())};
  } else if constexpr (std::is_same_v<acc_t, float> && at::vec::is_reduced_floating_point_v<X>) {
    return at::vec::convert_to_float<X>(Vectorized<X>::loadu(p));
  } else {
    alignas(64) acc_t wide[2 * Vec::size()];
    for (int64_t k = 0; k < 2 * Vec::size(); ++k) wide[k] = static_cast<acc_t>(p[k]);
    return {Vec::loadu(wide), Vec::loadu(wide + Vec::size())};
  }
}

template <typename acc_t, typename X>
void store_pair(X* p, Vectorized<acc_t> a, Vectorized<acc_t> b) {
  using Vec = Vectorized<acc_t>;
  if constexpr (std::is_same_v<X, acc_t>) {
    a.store(p);
    b.store(p + Vec::size());
  } else if constexpr (std::is_same_v<acc_t, float> && at::vec::is_reduced_floating_point_v<X>) {
    at::vec::convert_from_float<X>(a, b).store(p);
  } else {
    alignas(64) acc_t wide[2 * Vec::size()];
    a.store(wide);
    b.store(wide + Vec::size());
    for (int64_t k = 0; k < 2 * Vec::size(); ++k) p[k] = static_cast<X>(wide[k]);
  }
}

template <typename acc_t>
acc_t lane_sum(Vectorized<acc_t> v) {
  return at::vec::vec_reduce_all([](Vectorized<acc_t> a, Vectorized<acc_t> b) { return a + b; }, v);
}

// Asks for `bytes` from `next` (the same span of the row to come) into L2, from a pass over a row already in L1:
// such a pass makes no request of its own, and the memory would idle through it. The norm forward's last pass
// (op level, AVX2, in-process A/B at 768 columns: forward+backward with it / without it 0.95 / 1.00, 0.99 / 1.03
// and 1.01 / 1.04 (frozen fp32), 0.96 / 0.99 and 0.98 / 0.99 (bf16), alone at load 0.6; the forward alone read
// faster without it that day and slower the day before; the backward's passes gained nothing from it and lost in
// bfloat16).
template <typename X>
void prefetch_span(const X* next, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(next) + offset, /*rw=*/0, /*locality=*/2);
  }
}

// The sum of term(x) over a row of dim elements of X, in acc_t: term takes a Vectorized<acc_t> or an acc_t.
// Four vector accumulators, two pairs a step: each accumulator's adds wait on one another, and a pass over a
// row in cache was bound by that wait with two (the norm forward's second pass, AMD EPYC).
template <typename acc_t, typename X, typename Term>
acc_t row_sum(const X* xr, int64_t dim, Term term) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t kStep = 2 * Vec::size();
  Vec s0(0), s1(0), s2(0), s3(0);
  int64_t i = 0;
  for (; i + 2 * kStep <= dim; i += 2 * kStep) {
    const auto [x0, x1] = load_pair<acc_t>(xr + i);
    const auto [x2, x3] = load_pair<acc_t>(xr + i + kStep);
    s0 += term(x0);
    s1 += term(x1);
    s2 += term(x2);
    s3 += term(x3);
  }
  for (; i + kStep <= dim; i += kStep) {
    const auto [x0, x1] = load_pair<acc_t>(xr + i);
    s0 += term(x0);
    s1 += term(x1);
  }
  acc_t total = lane_sum((s0 + s1) + (s2 + s3));
  for (; i < dim; ++i) total += term(static_cast<acc_t>(xr[i]));
  return total;
}

// y = scale * z + shift for one pair of vectors of z (a null scale is 1, a null shift 0): one fused multiply-add
// with both (one rounding; the frozen norm's forward kernel 1-3% faster, AVX2, in-process A/B at load 1.3).
template <typename acc_t>
std::tuple<Vectorized<acc_t>, Vectorized<acc_t>> affine_pair(Vectorized<acc_t> y0, Vectorized<acc_t> y1,
                                                             const acc_t* scale, const acc_t* shift) {
  using Vec = Vectorized<acc_t>;
  if (scale != nullptr && shift != nullptr) {
    return {at::vec::fmadd(y0, Vec::loadu(scale), Vec::loadu(shift)),
            at::vec::fmadd(y1, Vec::loadu(scale + Vec::size()), Vec::loadu(shift + Vec::size()))};
  }
  if (scale != nullptr) {
    y0 = y0 * Vec::loadu(scale);
    y1 = y1 * Vec::loadu(scale + Vec::size());
  }
  if (shift != nullptr) {
    y0 = y0 + Vec::loadu(shift);
    y1 = y1 + Vec::loadu(shift + Vec::size());
  }
  return {y0, y1};
}

// Rows in parallel; per row the mean, then the centered sum of squares, then z: three passes over the
// row, all but the first from cache (the last asks for the next row meanwhile), in acc_t (fp32 for half/bfloat16,
// fp64 for fp64). A non-null y also gets the affine of z in the last pass: of z just stored (in cache), or of z
// unrounded, as stock's, when z is null. A non-null `exact` gets z at the n_columns `columns` of each row (rows x
// n_columns).
template <typename T, typename U>
void norm_forward_kernel(const T* x, int64_t rows, int64_t dim, double eps, bool center, U* z, at::opmath_type<T>* rstd,
                         const at::opmath_type<T>* scale, const at::opmath_type<T>* shift, U* y,
                         const int64_t* columns, int64_t n_columns, U* exact) {
  using acc_t = at::opmath_type<T>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t kStep = 2 * Vec::size();
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * dim;
      U* zr = z == nullptr ? nullptr : z + row * dim;
      const acc_t mean = center ? row_sum<acc_t>(xr, dim, [](auto v) { return v; }) / acc_t(dim) : acc_t(0);
      const Vec vmean(mean);
      const acc_t m2 = row_sum<acc_t>(xr, dim, [&](auto v) { return centered_square(v, decltype(v)(mean)); });
      const acc_t r = inverse_std(m2 / acc_t(dim), acc_t(eps));
      rstd[row] = r;
      const Vec vr(r);
      U* yr = y == nullptr ? nullptr : y + row * dim;
      const T* next = row + 1 < end ? xr + dim : nullptr;
      int64_t i = 0;
      for (; i + kStep <= dim; i += kStep) {
        if (next != nullptr) prefetch_span(next + i, kStep * int64_t(sizeof(T)));
        const auto [x0, x1] = load_pair<acc_t>(xr + i);
        const Vec z0 = normalized(x0, vmean, vr), z1 = normalized(x1, vmean, vr);
        if (zr != nullptr) store_pair<acc_t>(zr + i, z0, z1);
        if (yr != nullptr) {
          // the affine of z as stored: a narrower z is read back rounded, as its readers see it
          const auto [s0, s1] =
              zr == nullptr || std::is_same_v<U, acc_t> ? std::make_tuple(z0, z1) : load_pair<acc_t>(zr + i);
          const auto [y0, y1] = affine_pair<acc_t>(s0, s1, scale == nullptr ? nullptr : scale + i,
                                                   shift == nullptr ? nullptr : shift + i);
          store_pair<acc_t>(yr + i, y0, y1);
        }
      }
      for (; i < dim; ++i) {
        acc_t value = normalized(static_cast<acc_t>(xr[i]), mean, r);
        if (zr != nullptr) {
          zr[i] = static_cast<U>(value);
          value = static_cast<acc_t>(zr[i]);
        }
        if (yr == nullptr) continue;
        if (scale != nullptr && shift != nullptr) {
          value = std::fma(value, scale[i], shift[i]);  // as affine_pair
        } else if (scale != nullptr) {
          value = value * scale[i];
        } else if (shift != nullptr) {
          value = value + shift[i];
        }
        yr[i] = static_cast<U>(value);
      }
      for (int64_t c = 0; c < n_columns; ++c) {
        exact[row * n_columns + c] = static_cast<U>(normalized(static_cast<acc_t>(xr[columns[c]]), mean, r));
      }
    }
  });
}

// Rows in parallel; per row the sums of g' = g*scale and g'*z, then dx: two passes over the row, the second
// from cache. kSums: the second pass also adds g*z and g into its thread's own column sums (stock LayerNorm's
// gamma / beta gradients), which are added up at the end.
template <bool kScale, bool kSums, typename U, typename T>
void norm_backward_kernel(const U* grad, const U* z, const at::opmath_type<U>* rstd, const at::opmath_type<U>* scale,
                          int64_t rows, int64_t dim, bool center, T* grad_input, at::opmath_type<U>* sums) {
  using acc_t = at::opmath_type<U>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t kStep = 2 * Vec::size();
  const int threads = kSums ? at::get_num_threads() : 0;
  Scratch<acc_t> partial(kSums ? 2 * dim * threads : 0, acc_t(0));
  const auto scaled = [&](Vec g, int64_t i) { return kScale ? g * Vec::loadu(scale + i) : g; };
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    acc_t* sum_gz = kSums ? partial.data() + 2 * dim * at::get_thread_num() : nullptr;
    acc_t* sum_g = kSums ? sum_gz + dim : nullptr;
    for (int64_t row = begin; row < end; ++row) {
      const U* g = grad + row * dim;
      const U* zr = z + row * dim;
      T* dx = grad_input + row * dim;
      Vec sum_g0(0), sum_g1(0), sum_gz0(0), sum_gz1(0);
      int64_t i = 0;
      for (; i + kStep <= dim; i += kStep) {
        auto [g0, g1] = load_pair<acc_t>(g + i);
        const auto [z0, z1] = load_pair<acc_t>(zr + i);
        g0 = scaled(g0, i);
        g1 = scaled(g1, i + Vec::size());
        sum_g0 += g0;
        sum_g1 += g1;
        sum_gz0 = at::vec::fmadd(g0, z0, sum_gz0);
        sum_gz1 = at::vec::fmadd(g1, z1, sum_gz1);
      }
      acc_t total_g = lane_sum(sum_g0 + sum_g1), total_gz = lane_sum(sum_gz0 + sum_gz1);
      for (int64_t k = i; k < dim; ++k) {
        const acc_t gk = static_cast<acc_t>(g[k]) * (kScale ? scale[k] : acc_t(1));
        total_g += gk;
        total_gz += gk * static_cast<acc_t>(zr[k]);
      }
      const acc_t mean_g = center ? total_g / acc_t(dim) : acc_t(0), mean_gz = total_gz / acc_t(dim), r = rstd[row];
      const Vec vr(r), vmean_g(mean_g), vmean_gz(mean_gz);
      for (i = 0; i + kStep <= dim; i += kStep) {
        const auto [g0, g1] = load_pair<acc_t>(g + i);
        const auto [z0, z1] = load_pair<acc_t>(zr + i);
        const int64_t j = i + Vec::size();
        store_pair<acc_t>(dx + i, norm_input_grad(scaled(g0, i), z0, vr, vmean_g, vmean_gz),
                          norm_input_grad(scaled(g1, j), z1, vr, vmean_g, vmean_gz));
        if constexpr (kSums) {
          at::vec::fmadd(g0, z0, Vec::loadu(sum_gz + i)).store(sum_gz + i);
          at::vec::fmadd(g1, z1, Vec::loadu(sum_gz + j)).store(sum_gz + j);
          (g0 + Vec::loadu(sum_g + i)).store(sum_g + i);
          (g1 + Vec::loadu(sum_g + j)).store(sum_g + j);
        }
      }
      for (; i < dim; ++i) {
        const acc_t gi = static_cast<acc_t>(g[i]), zi = static_cast<acc_t>(zr[i]);
        dx[i] = static_cast<T>(norm_input_grad(gi * (kScale ? scale[i] : acc_t(1)), zi, r, mean_g, mean_gz));
        if constexpr (kSums) {
          sum_gz[i] += gi * zi;
          sum_g[i] += gi;
        }
      }
    }
  });
  if constexpr (kSums) {  // the threads' partial sums in a fixed order
    for (int64_t k = 0; k < 2 * dim; ++k) {
      at::opmath_type<U> total = 0;
      for (int t = 0; t < threads; ++t) total += partial[2 * dim * t + k];
      sums[k] = total;
    }
  }
}

// norm_backward_kernel's input gradient (scale, no column sums) from the output y = scale * z + shift instead
// of z, so both passes read y where the other reads z. The first pass sums g' = g * scale and g' * z as
// g * (y - shift) (four loads a vector, not five: the kernel 0.95-0.99x its time under AVX2 but at 768 fp32
// columns, 1.01x, and 0.98-1.00x under AVX512, in-process A/B at load 0.4); the second rebuilds z = y * inverse_scale - shifted (shifted = shift * inverse_scale) in
// registers by one fused multiply-add. inverse_scale and shifted are 0 at the n_columns `columns` whose z y
// cannot give back (scale 0, or |shift| > |scale|); their z comes from `exact` (rows x n_columns): it replaces
// their terms of the row's sum of g'*z and, after the second pass, their own dx. kRows rows at a time: each
// vector of the per-column values, loaded once, serves them all (a row at a time, the loads bound the kernel:
// fwd+bwd 1.1-1.5x stock's at ViT shapes, AMD EPYC).
template <int kRows, typename U, typename T>
void norm_output_backward_rows(const U* grad, const U* y, const at::opmath_type<U>* rstd,
                               const at::opmath_type<U>* scale, const at::opmath_type<U>* shift,
                               const at::opmath_type<U>* inverse_scale, const at::opmath_type<U>* shifted,
                               const int64_t* columns, int64_t n_columns, const U* exact, int64_t dim, bool center,
                               T* grad_input) {
  using acc_t = at::opmath_type<U>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t kStep = 2 * Vec::size();
  const auto pair = [](const acc_t* values, int64_t i) {
    return std::array<Vec, 2>{Vec::loadu(values + i), Vec::loadu(values + i + Vec::size())};
  };
  Vec sum_g[kRows], sum_gz[kRows];
  for (int q = 0; q < kRows; ++q) sum_g[q] = sum_gz[q] = Vec(0);
  int64_t i = 0;
  for (; i + kStep <= dim; i += kStep) {
    const auto [gamma0, gamma1] = pair(scale, i);
    const auto [shift0, shift1] = pair(shift, i);
    for (int q = 0; q < kRows; ++q) {
      const auto [g0, g1] = load_pair<acc_t>(grad + q * dim + i);
      const auto [y0, y1] = load_pair<acc_t>(y + q * dim + i);
      sum_g[q] += at::vec::fmadd(g1, gamma1, g0 * gamma0);
      sum_gz[q] += at::vec::fmadd(g1, y1 - shift1, g0 * (y0 - shift0));
    }
  }
  const int64_t tail = i;
  acc_t r[kRows], mean_g[kRows], mean_gz[kRows];
  for (int q = 0; q < kRows; ++q) {
    const U* g = grad + q * dim;
    const U* yr = y + q * dim;
    acc_t total_g = lane_sum(sum_g[q]), total_gz = lane_sum(sum_gz[q]);
    for (int64_t k = tail; k < dim; ++k) {
      total_g += static_cast<acc_t>(g[k]) * scale[k];
      total_gz += static_cast<acc_t>(g[k]) * (static_cast<acc_t>(yr[k]) - shift[k]);
    }
    for (int64_t c = 0; c < n_columns; ++c) {  // y - shift is not scale * z there: its own z instead
      const int64_t k = columns[c];
      const acc_t gk = static_cast<acc_t>(g[k]);
      const acc_t rebuilt = static_cast<acc_t>(yr[k]) - shift[k];
      total_gz += gk * (scale[k] * static_cast<acc_t>(exact[q * n_columns + c]) - rebuilt);
    }
    r[q] = rstd[q];
    mean_g[q] = center ? total_g / acc_t(dim) : acc_t(0);
    mean_gz[q] = total_gz / acc_t(dim);
  }
  for (i = 0; i + kStep <= dim; i += kStep) {
    const auto [gamma0, gamma1] = pair(scale, i);
    const auto [inverse0, inverse1] = pair(inverse_scale, i);
    const auto [shifted0, shifted1] = pair(shifted, i);
    for (int q = 0; q < kRows; ++q) {
      const auto [g0, g1] = load_pair<acc_t>(grad + q * dim + i);
      const auto [y0, y1] = load_pair<acc_t>(y + q * dim + i);
      const Vec vr(r[q]), vmean_g(mean_g[q]), vmean_gz(mean_gz[q]);
      store_pair<acc_t>(grad_input + q * dim + i,
                        norm_input_grad(g0 * gamma0, at::vec::fmsub(y0, inverse0, shifted0), vr, vmean_g, vmean_gz),
                        norm_input_grad(g1 * gamma1, at::vec::fmsub(y1, inverse1, shifted1), vr, vmean_g, vmean_gz));
    }
  }
  for (int q = 0; q < kRows; ++q) {
    const U* g = grad + q * dim;
    T* dx = grad_input + q * dim;
    for (int64_t k = tail; k < dim; ++k) {
      const acc_t zk = static_cast<acc_t>(y[q * dim + k]) * inverse_scale[k] - shifted[k];
      dx[k] = static_cast<T>(norm_input_grad(static_cast<acc_t>(g[k]) * scale[k], zk, r[q], mean_g[q], mean_gz[q]));
    }
    for (int64_t c = 0; c < n_columns; ++c) {
      const int64_t k = columns[c];
      dx[k] = static_cast<T>(norm_input_grad(static_cast<acc_t>(g[k]) * scale[k],
                                             static_cast<acc_t>(exact[q * n_columns + c]), r[q], mean_g[q], mean_gz[q]));
    }
  }
}

// Rows in parallel, four at a time (norm_output_backward_rows; 2 and 8 measured slower), the rest one by one;
// fp32 rows of up to 4 KB all one by one: four such rows interleaved, read from L3 or memory, ran at 1.5x
// ATen's time (768 columns; one by one 1.1x), while from 1536 columns on four rows run at 0.8-1.0x against
// one's 1.1-1.3x, and bf16 at 0.76-0.81x at every width (AMD EPYC, AVX512, interleaved with ATen's backward).
// Under AVX2 bf16 rows of up to 4 KB go one by one too: by four, 768 columns ran the backward at 1.28x ATen's,
// one by one 0.97x; 3072 columns by four 0.94x, one by one 1.16x (the same EPYC, ATEN_CPU_CAPABILITY=avx2).
// Measured slower for fp32 768 columns read from memory (AVX2, against one by one at 1.03-1.21x ATen's): two rows
// sharing the second pass's column loads 1.4-1.7x (op level), dx's partial term written in the first pass
// 1.08-1.14x, the rows prefetched 128-512 floats ahead in the first pass 1.11-1.19x; streaming stores of dx
// 1.05x from memory but 1.6-2.0x from cache.
template <typename U, typename T>
void norm_output_backward_kernel(const U* grad, const U* y, const at::opmath_type<U>* rstd,
                                 const at::opmath_type<U>* scale, const at::opmath_type<U>* shift,
                                 const at::opmath_type<U>* inverse_scale, const at::opmath_type<U>* shifted,
                                 const int64_t* columns, int64_t n_columns, const U* exact, int64_t rows, int64_t dim,
                                 bool center, T* grad_input) {
#if defined(CPU_CAPABILITY_AVX512)
  const bool by_four = sizeof(U) < sizeof(float) || dim * int64_t(sizeof(U)) > 4096;
#else  // AVX2's 16 vector registers: four rows' sums beside the six column vectors spill
  const bool by_four = dim * int64_t(sizeof(U)) > 4096;
#endif
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    int64_t row = begin;
    const auto run = [&](auto count) {
      norm_output_backward_rows<decltype(count)::value>(grad + row * dim, y + row * dim, rstd + row, scale,
                                                        shift, inverse_scale, shifted, columns, n_columns,
                                                        exact + row * n_columns, dim, center, grad_input + row * dim);
      row += decltype(count)::value;
    };
    while (by_four && row + 4 <= end) run(std::integral_constant<int, 4>());
    while (row < end) run(std::integral_constant<int, 1>());
  });
}

// Transcendentals and select for activation_and_slope / gated_grads: std:: for scalars, at::vec for
// vectors; the fp32 exp is ATen's faster one (within 20 ulp; what ATen's own activation kernels use).
struct CpuMath {
  template <typename T> static T exp(T x) { return std::exp(x); }
  template <typename T> static T erf(T x) { return std::erf(x); }
  template <typename T> static T tanh(T x) { return std::tanh(x); }
  template <typename T> static T nonzero_or_zero(T cond, T value) { return cond != T(0) ? value : T(0); }
  static Vectorized<float> exp(Vectorized<float> x) { return x.exp_u20(); }
  static Vectorized<double> exp(Vectorized<double> x) { return x.exp(); }
  template <typename T> static Vectorized<T> erf(Vectorized<T> x) { return x.erf(); }
  template <typename T> static Vectorized<T> tanh(Vectorized<T> x) { return x.tanh(); }
  template <typename T> static Vectorized<T> nonzero_or_zero(Vectorized<T> cond, Vectorized<T> value) {
    const Vectorized<T> zero(T(0));
    return Vectorized<T>::blendv(zero, value, cond != zero);
  }
};

// fp32 / fp64: one vectorized pass straight over the tensors; act(gate) is the forward's (`act`, with
// kRecoverUp) or evaluated here (already in T).
template <Activation kKind, bool kRecoverUp, typename T>
void gated_backward_kernel(const T* grad, const T* gate, const T* second, const T* act, int64_t numel, T* grad_gate,
                           T* grad_up) {
  at::parallel_for(0, numel, 2048, [&](int64_t begin, int64_t end) {
    row_for_each<T>(end - begin, [&](int64_t k, auto v) {
      using V = decltype(v);
      const int64_t i = begin + k;
      V value, slope, dg, du;
      activation_and_slope<kKind, CpuMath>(load(gate, i, v), value, slope);
      if constexpr (kRecoverUp) value = load(act, i, v);
      gated_grads<kRecoverUp, CpuMath>(load(grad, i, v), value, slope, load(second, i, v), dg, du);
      store(grad_gate, i, dg);
      store(grad_up, i, du);
    });
  });
}

// fp16 / bf16: each vector of T widened to two fp32 vectors in registers (no staging buffers); act(gate)
// is the forward's (`act`, with kRecoverUp) or evaluated here and rounded to T and back; scalar tail.
template <Activation kKind, bool kRecoverUp, typename T>
void gated_backward_reduced_kernel(const T* grad, const T* gate, const T* second, const T* act, int64_t numel,
                                   T* grad_gate, T* grad_up) {
  using bVec = Vectorized<T>;
  using fVec = Vectorized<float>;
  at::parallel_for(0, numel, 2048, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + bVec::size() <= end; i += bVec::size()) {
      auto [g0, g1] = at::vec::convert_to_float<T>(bVec::loadu(gate + i));
      auto [dh0, dh1] = at::vec::convert_to_float<T>(bVec::loadu(grad + i));
      auto [x0, x1] = at::vec::convert_to_float<T>(bVec::loadu(second + i));
      fVec a0, a1, d0, d1;
      activation_and_slope<kKind, CpuMath>(g0, a0, d0);
      activation_and_slope<kKind, CpuMath>(g1, a1, d1);
      if constexpr (kRecoverUp) {
        std::tie(a0, a1) = at::vec::convert_to_float<T>(bVec::loadu(act + i));
      } else {
        std::tie(a0, a1) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a0, a1));
      }
      fVec dg0, dg1, du0, du1;
      gated_grads<kRecoverUp, CpuMath>(dh0, a0, d0, x0, dg0, du0);
      gated_grads<kRecoverUp, CpuMath>(dh1, a1, d1, x1, dg1, du1);
      at::vec::convert_from_float<T>(dg0, dg1).store(grad_gate + i);
      at::vec::convert_from_float<T>(du0, du1).store(grad_up + i);
    }
    for (; i < end; ++i) {
      float value, slope, dg, du;
      activation_and_slope<kKind, CpuMath>(static_cast<float>(gate[i]), value, slope);
      value = static_cast<float>(kRecoverUp ? act[i] : static_cast<T>(value));
      gated_grads<kRecoverUp, CpuMath>(static_cast<float>(grad[i]), value, slope, static_cast<float>(second[i]), dg, du);
      grad_gate[i] = static_cast<T>(dg);
      grad_up[i] = static_cast<T>(du);
    }
  });
}

// A row of `n` values widened to fp32 (`dst`; kDivide: divided by `divisor`, as the log-probs' logits by the
// temperature), and fp32 values times `scale` rounded into a row (in place for fp32).
template <bool kDivide, typename T>
void load_row(const T* src, float divisor, float* dst, int64_t n) {
  using fVec = Vectorized<float>;
  const fVec divisor_v(divisor);
  const auto put = [&](fVec v, int64_t i) { (kDivide ? v / divisor_v : v).store(dst + i); };
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + fVec::size() <= n; i += fVec::size()) put(fVec::loadu(src + i), i);
  } else {
    for (; i + Vectorized<T>::size() <= n; i += Vectorized<T>::size()) {
      auto [a, b] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(src + i));
      put(a, i);
      put(b, i + fVec::size());
    }
  }
  for (; i < n; ++i) dst[i] = kDivide ? static_cast<float>(src[i]) / divisor : static_cast<float>(src[i]);
}

template <typename T>
void store_row(const float* src, float scale, T* dst, int64_t n) {
  using fVec = Vectorized<float>;
  const fVec scale_v(scale);
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + fVec::size() <= n; i += fVec::size()) (fVec::loadu(src + i) * scale_v).store(dst + i);
  } else {
    for (; i + Vectorized<T>::size() <= n; i += Vectorized<T>::size()) {
      const fVec a = fVec::loadu(src + i) * scale_v, b = fVec::loadu(src + i + fVec::size()) * scale_v;
      at::vec::convert_from_float<T>(a, b).store(dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i] * scale);
}

// Cross-entropy of one row of logits, overwritten with its gradient: (capped and) summed and maxed in one
// pass, exp-summed in a second, turned into softmax - (1 - eps) * onehot - eps / V (times the capping's slope
// 1 - (c / cap)^2) in a third; the row stays in cache between them (a fused head passes rows of a chunk).
template <bool kCap>
float cross_entropy_row(float* row, int64_t vocab, int64_t target, float eps, float cap) {
  using fVec = Vectorized<float>;
  const fVec cap_v(cap), inv_cap_v(kCap ? 1.0f / cap : 1.0f);
  fVec max_v(-std::numeric_limits<float>::infinity()), sum_v(0.0f);
  float max_s = -std::numeric_limits<float>::infinity(), sum_s = 0.0f;
  int64_t v = 0;
  for (; v + fVec::size() <= vocab; v += fVec::size()) {
    fVec c = fVec::loadu(row + v);
    if constexpr (kCap) {
      c = cap_v * (c * inv_cap_v).tanh();
      c.store(row + v);
    }
    max_v = at::vec::maximum(max_v, c);
    sum_v = sum_v + c;
  }
  for (; v < vocab; ++v) {
    float c = row[v];
    if constexpr (kCap) row[v] = c = cap * std::tanh(c / cap);
    max_s = std::max(max_s, c);
    sum_s += c;
  }
  const float peak = std::max(max_s, at::vec::vec_reduce_all([](fVec a, fVec b) { return at::vec::maximum(a, b); },
                                                             max_v));
  const float total = sum_s + at::vec::vec_reduce_all([](fVec a, fVec b) { return a + b; }, sum_v);
  const fVec peak_v(peak);
  fVec exp_v(0.0f);
  float exp_s = 0.0f;
  for (v = 0; v + fVec::size() <= vocab; v += fVec::size()) exp_v = exp_v + (fVec::loadu(row + v) - peak_v).exp();
  for (; v < vocab; ++v) exp_s += std::exp(row[v] - peak);
  const float sum_exp = exp_s + at::vec::vec_reduce_all([](fVec a, fVec b) { return a + b; }, exp_v);
  const float picked = row[target];
  const float loss = peak + std::log(sum_exp) - (1.0f - eps) * picked - eps * total / static_cast<float>(vocab);
  const fVec inv_v(1.0f / sum_exp), smooth_v(eps / static_cast<float>(vocab)), one_v(1.0f);
  for (v = 0; v + fVec::size() <= vocab; v += fVec::size()) {
    const fVec c = fVec::loadu(row + v);
    fVec g = (c - peak_v).exp() * inv_v - smooth_v;
    if constexpr (kCap) g = g * (one_v - (c * inv_cap_v) * (c * inv_cap_v));
    g.store(row + v);
  }
  for (; v < vocab; ++v) {
    const float c = row[v];
    float g = std::exp(c - peak) / sum_exp - eps / static_cast<float>(vocab);
    if constexpr (kCap) g *= 1.0f - (c / cap) * (c / cap);
    row[v] = g;
  }
  row[target] -= (1.0f - eps) * (kCap ? 1.0f - (picked / cap) * (picked / cap) : 1.0f);
  return loss;
}

// Each row of a chunk: its loss, and the row overwritten with its gradient times its scale (a half-precision row is
// worked on in fp32 in this thread's copy, in cache, then rounded back once).
template <typename T>
void cross_entropy_rows(T* rows, const int64_t* targets, int64_t ignore_index, int64_t count, int64_t vocab,
                        float eps, float cap, const float* scales, float* losses) {
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    Scratch<float> copy(std::is_same_v<T, float> ? 0 : vocab);
    for (int64_t r = begin; r < end; ++r) {
      T* row = rows + r * vocab;
      if (targets[r] == ignore_index) {
        std::fill(row, row + vocab, static_cast<T>(0.0f));
        losses[r] = 0.0f;
        continue;
      }
      float* work;
      if constexpr (std::is_same_v<T, float>) {
        work = row;
      } else {
        work = copy.data();
        load_row<false>(row, 1.0f, work, vocab);
      }
      losses[r] = cap > 0 ? cross_entropy_row<true>(work, vocab, targets[r], eps, cap)
                          : cross_entropy_row<false>(work, vocab, targets[r], eps, cap);
      if (scales != nullptr || !std::is_same_v<T, float>) store_row(work, scales ? scales[r] : 1.0f, row, vocab);
    }
  });
}

// lse = logsumexp(s) and the entropy lse - sum(p s) of a row of scaled logits s: its max in one pass, the sums in a
// second, the entropy as log(sum) - sum(p (s - max)): no cancellation between two large numbers where the logits are.
std::pair<float, float> lse_and_entropy(const float* s, int64_t vocab) {
  using fVec = Vectorized<float>;
  const auto sum = [](fVec a, fVec b) { return a + b; };
  fVec max_v(-std::numeric_limits<float>::infinity());
  float peak = -std::numeric_limits<float>::infinity();
  int64_t v = 0;
  for (; v + fVec::size() <= vocab; v += fVec::size()) max_v = at::vec::maximum(max_v, fVec::loadu(s + v));
  for (; v < vocab; ++v) peak = std::max(peak, s[v]);
  peak = std::max(peak, at::vec::vec_reduce_all([](fVec a, fVec b) { return at::vec::maximum(a, b); }, max_v));
  const fVec peak_v(peak);
  fVec exp_v(0.0f), weighted_v(0.0f);
  float exp_s = 0.0f, weighted_s = 0.0f;
  for (v = 0; v + fVec::size() <= vocab; v += fVec::size()) {
    const fVec x = fVec::loadu(s + v) - peak_v, e = x.exp();
    exp_v = exp_v + e;
    weighted_v = weighted_v + e * x;
  }
  for (; v < vocab; ++v) {
    const float x = s[v] - peak, e = std::exp(x);
    exp_s += e;
    weighted_s += e * x;
  }
  const float sum_exp = exp_s + at::vec::vec_reduce_all(sum, exp_v), log_sum = std::log(sum_exp);
  return {peak + log_sum, log_sum - (weighted_s + at::vec::vec_reduce_all(sum, weighted_v)) / sum_exp};
}

template <typename T>
void token_log_probs_rows(const T* rows, const int64_t* targets, int64_t ignore_index, int64_t count, int64_t vocab,
                          float temperature, float* log_prob, float* entropy, float* lse) {
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    Scratch<float> s(vocab);
    for (int64_t r = begin; r < end; ++r) {
      load_row<true>(rows + r * vocab, temperature, s.data(), vocab);
      const auto [row_lse, row_entropy] = lse_and_entropy(s.data(), vocab);
      const bool ignored = targets[r] == ignore_index;
      lse[r] = row_lse;
      log_prob[r] = ignored ? 0.0f : s[targets[r]] - row_lse;
      entropy[r] = ignored ? 0.0f : row_entropy;
    }
  });
}

template <typename T>
void token_log_probs_grad_rows(T* rows, const int64_t* targets, int64_t ignore_index, int64_t count, int64_t vocab,
                               float temperature, const float* lse, const float* entropy, const float* grad_log_prob,
                               const float* grad_entropy) {
  using fVec = Vectorized<float>;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    Scratch<float> s(vocab);
    for (int64_t r = begin; r < end; ++r) {
      T* row = rows + r * vocab;
      if (targets[r] == ignore_index) {
        std::fill(row, row + vocab, static_cast<T>(0.0f));
        continue;
      }
      load_row<true>(row, temperature, s.data(), vocab);
      const float g_lp = grad_log_prob[r], g_h = grad_entropy ? grad_entropy[r] : 0.0f;
      const fVec lse_v(lse[r]), h_v(entropy[r]), g_lp_v(g_lp), g_h_v(g_h);
      int64_t v = 0;
      for (; v + fVec::size() <= vocab; v += fVec::size()) {
        const fVec log_p = fVec::loadu(s.data() + v) - lse_v, p = log_p.exp();
        (p * (fVec(0.0f) - g_lp_v) - g_h_v * p * (log_p + h_v)).store(s.data() + v);
      }
      for (; v < vocab; ++v) {
        const float log_p = s[v] - lse[r], p = std::exp(log_p);
        s[v] = -g_lp * p - g_h * p * (log_p + entropy[r]);
      }
      s[targets[r]] += g_lp;
      store_row(s.data(), 1.0f / temperature, row, vocab);
    }
  });
}

// Dropout: the Philox words of a block of counters computed structure-of-arrays (each round one loop over the
// counters, which the compiler vectorizes), then the block's elements kept and scaled, or zeroed.
constexpr int64_t kDropoutCounters = 256;  // 1024 elements per block

void philox_words(uint64_t seed, uint64_t first, int64_t n, uint32_t* words) {
  alignas(64) uint32_t c0[kDropoutCounters], c1[kDropoutCounters], c2[kDropoutCounters], c3[kDropoutCounters];
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t counter = first + static_cast<uint64_t>(j);
    c0[j] = static_cast<uint32_t>(counter);
    c1[j] = static_cast<uint32_t>(counter >> 32);
    c2[j] = c3[j] = 0;
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < kPhiloxRounds; ++round) {
    for (int64_t j = 0; j < n; ++j) philox_round(c0[j], c1[j], c2[j], c3[j], k0, k1);
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  for (int64_t j = 0; j < n; ++j) {
    words[4 * j] = c0[j];
    words[4 * j + 1] = c1[j];
    words[4 * j + 2] = c2[j];
    words[4 * j + 3] = c3[j];
  }
}

template <typename T>
void dropout_kernel(const T* x, int64_t numel, PhiloxSeed seed, uint32_t threshold, at::opmath_type<T> scale, T* out) {
  using acc_t = at::opmath_type<T>;
  const int64_t counters = (numel + 3) / 4;
  at::parallel_for(0, counters, 4 * kDropoutCounters, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t words[4 * kDropoutCounters];
    for (int64_t first = begin; first < end; first += kDropoutCounters) {
      const int64_t n = std::min(kDropoutCounters, end - first);
      philox_words(seed.key, seed.first + static_cast<uint64_t>(first), n, words);
      const int64_t offset = 4 * first, count = std::min(4 * n, numel - offset);
      const T* src = x + offset;
      T* dst = out + offset;
      for (int64_t i = 0; i < count; ++i) {
        dst[i] = static_cast<T>(words[i] >= threshold ? static_cast<acc_t>(src[i]) * scale : acc_t(0));
      }
    }
  });
}

// dropout_input_and_grad: both outputs from one mask per Philox block, the input rebuilt by its affine on the way
// (rounded to x's dtype, as the norm rounded its output, then to T's).
template <typename X, typename T>
void dropout_pair_kernel(const X* x, const at::opmath_type<T>* scale, const at::opmath_type<T>* shift, int64_t dim,
                         const T* grad, int64_t numel, PhiloxSeed seed, uint32_t threshold,
                         at::opmath_type<T> kept_scale, T* read, T* masked) {
  using acc_t = at::opmath_type<T>;
  const int64_t counters = (numel + 3) / 4;
  at::parallel_for(0, counters, 4 * kDropoutCounters, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t words[4 * kDropoutCounters];
    for (int64_t first = begin; first < end; first += kDropoutCounters) {
      const int64_t n = std::min(kDropoutCounters, end - first);
      philox_words(seed.key, seed.first + static_cast<uint64_t>(first), n, words);
      const int64_t offset = 4 * first, count = std::min(4 * n, numel - offset);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t at = offset + i;
        const bool keep = words[i] >= threshold;
        acc_t v = static_cast<acc_t>(x[at]);
        if (scale != nullptr) v = v * scale[at % dim];
        if (shift != nullptr) v = v + shift[at % dim];
        const acc_t rebuilt = static_cast<acc_t>(static_cast<T>(static_cast<acc_t>(static_cast<X>(v))));
        read[at] = static_cast<T>(keep ? rebuilt * kept_scale : acc_t(0));
        masked[at] = static_cast<T>(keep ? static_cast<acc_t>(grad[at]) * kept_scale : acc_t(0));
      }
    }
  });
}

}  // namespace

// The table's `count` thresholds in acc_t, the rest of the storage's slots +inf (codes never reach them).
template <int kBits, typename acc_t>
std::array<acc_t, Packing<kBits>::kThresholds> padded_thresholds(const double* thresholds, int64_t count) {
  std::array<acc_t, Packing<kBits>::kThresholds> padded;
  for (int t = 0; t < Packing<kBits>::kThresholds; ++t) {
    padded[t] = t < count ? acc_t(thresholds[t]) : std::numeric_limits<acc_t>::infinity();
  }
  return padded;
}

void act_codes(const at::Tensor& x, const double* thresholds_in, int64_t count, at::Tensor& packed) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "act_codes", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dispatch_bits(storage_bits(count), [&](auto bits) {
      constexpr int kBits = decltype(bits)::value;
      const auto thresholds = padded_thresholds<kBits, acc_t>(thresholds_in, count);
      act_codes_kernel<kBits>(x.const_data_ptr<scalar_t>(), x.numel(), thresholds.data(),
                              packed.mutable_data_ptr<uint8_t>());
    });
  });
}

void act_forward(const at::Tensor& x, Activation kind, const double* thresholds, int64_t count, at::Tensor& y,
                 at::Tensor& packed) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (kind == Activation::kSilu && x.scalar_type() == at::kFloat) {
    dispatch_bits(storage_bits(count), [&](auto bits) {
      constexpr int kBits = decltype(bits)::value;
      const auto steps = padded_thresholds<kBits, float>(thresholds, count);
      silu_codes_kernel<kBits>(x.const_data_ptr<float>(), x.numel(), steps.data(), y.mutable_data_ptr<float>(),
                               packed.mutable_data_ptr<uint8_t>());
    });
    return;
  }
#endif
  act_codes(x, thresholds, count, packed);  // first: x is still in cache from the op that wrote it
  stock_activation_out(x, kind, y);
}

void step_scale(const at::Tensor& grad, const at::Tensor& packed, const double* levels, int64_t count, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "step_scale", [&] {
    dispatch_bits(storage_bits(count - 1), [&](auto bits) {
      step_scale_kernel<decltype(bits)::value>(grad.const_data_ptr<scalar_t>(), packed.const_data_ptr<uint8_t>(),
                                               grad.numel(), levels, count, out.mutable_data_ptr<scalar_t>());
    });
  });
}

namespace {

// `n` values of `t` as acc_t into `out` (a loop: this runs on every call), or `absent` where t is undefined.
template <typename acc_t>
void widen_into(const at::Tensor& t, acc_t absent, acc_t* out, int64_t n) {
  if (!t.defined()) {
    std::fill(out, out + n, absent);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "widen_into", [&] {
    const scalar_t* values = t.const_data_ptr<scalar_t>();
    for (int64_t k = 0; k < n; ++k) out[k] = static_cast<acc_t>(values[k]);
  });
}

// An affine's values as acc_t: the tensor's own where it holds acc_t, else widened into `buffer` (the output ops
// take a frozen half / bfloat16 weight as it is: a loop, where a cast before the call cost each call two
// operators, 3-4% of a bfloat16 norm's forward); null where undefined.
template <typename acc_t>
const acc_t* affine_data(const at::Tensor& t, Scratch<acc_t>& buffer) {
  if (!t.defined()) return nullptr;
  if (t.scalar_type() == c10::CppTypeToScalarType<acc_t>::value) return t.const_data_ptr<acc_t>();
  buffer.resize(t.numel());
  widen_into(t, acc_t(0), buffer.data(), t.numel());
  return buffer.data();
}

// The forward of both norm_forward and norm_output_forward: z and y each written when defined.
void norm_forward_into(const at::Tensor& x, int64_t dim, double eps, bool center, at::Tensor& z, at::Tensor& rstd,
                       const at::Tensor& scale, const at::Tensor& shift, at::Tensor& y, const at::Tensor& columns,
                       at::Tensor& exact) {
  const at::ScalarType out_dtype = z.defined() ? z.scalar_type() : y.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "norm_forward", [&] {
    using in_t = scalar_t;
    using acc_t = at::opmath_type<in_t>;
    Scratch<acc_t> scale_buffer, shift_buffer;
    const acc_t* scale_values = affine_data(scale, scale_buffer);
    const acc_t* shift_values = affine_data(shift, shift_buffer);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "norm_forward", [&] {
      const auto out = [](at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<scalar_t>() : nullptr; };
      norm_forward_kernel(x.const_data_ptr<in_t>(), rstd.numel(), dim, eps, center, out(z),
                          rstd.mutable_data_ptr<acc_t>(), scale_values, shift_values, out(y),
                          columns.defined() ? columns.const_data_ptr<int64_t>() : nullptr,
                          columns.defined() ? columns.numel() : 0, out(exact));
    });
  });
}

}  // namespace

void norm_forward(const at::Tensor& x, int64_t dim, double eps, bool center, at::Tensor& z, at::Tensor& rstd,
                  const at::Tensor& scale, const at::Tensor& shift, at::Tensor& y) {
  at::Tensor none;
  norm_forward_into(x, dim, eps, center, z, rstd, scale, shift, y, none, none);
}

void norm_output_forward(const at::Tensor& x, int64_t dim, double eps, bool center, at::Tensor& rstd,
                         const at::Tensor& scale, const at::Tensor& shift, at::Tensor& y, const at::Tensor& columns,
                         at::Tensor& exact) {
  at::Tensor none;
  norm_forward_into(x, dim, eps, center, none, rstd, scale, shift, y, columns, exact);
}

void norm_output_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rstd, const at::Tensor& scale,
                          const at::Tensor& shift, const at::Tensor& columns, const at::Tensor& exact, int64_t dim,
                          bool center, at::Tensor& grad_input) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "norm_output_backward", [&] {
    using out_t = scalar_t;
    using acc_t = at::opmath_type<out_t>;
    // the kernel's per-column values, each array from a cache line's start (a loop: ATen ops on these few values
    // would cost more than they do; one allocation: this runs on every backward)
    constexpr int64_t kLine = 64 / sizeof(acc_t);
    const int64_t stride = (dim + kLine - 1) / kLine * kLine;
    Scratch<acc_t> values(4 * stride);
    acc_t *gamma = values.data(), *beta = gamma + stride, *inverse = beta + stride, *shifted = inverse + stride;
    widen_into(scale, acc_t(1), gamma, dim);
    widen_into(shift, acc_t(0), beta, dim);
    for (int64_t k = 0; k < dim; ++k) {
      inverse[k] = acc_t(1) / gamma[k];
      shifted[k] = beta[k] * inverse[k];
    }
    const int64_t* index = columns.const_data_ptr<int64_t>();
    for (int64_t c = 0; c < columns.numel(); ++c) inverse[index[c]] = shifted[index[c]] = acc_t(0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_input.scalar_type(), "norm_output_backward", [&] {
      norm_output_backward_kernel(grad.const_data_ptr<out_t>(), y.const_data_ptr<out_t>(), rstd.const_data_ptr<acc_t>(),
                                  gamma, beta, inverse, shifted, index, columns.numel(),
                                  exact.const_data_ptr<out_t>(), rstd.numel(), dim, center,
                                  grad_input.mutable_data_ptr<scalar_t>());
    });
  });
}

void norm_backward(const at::Tensor& grad, const at::Tensor& z, const at::Tensor& rstd, const at::Tensor& scale,
                   int64_t dim, bool center, at::Tensor& grad_input, at::Tensor& sums) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "norm_backward", [&] {
    using out_t = scalar_t;
    using acc_t = at::opmath_type<out_t>;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_input.scalar_type(), "norm_backward", [&] {
      const auto run = [&](auto has_scale, auto has_sums) {
        norm_backward_kernel<decltype(has_scale)::value, decltype(has_sums)::value>(
            grad.const_data_ptr<out_t>(), z.const_data_ptr<out_t>(), rstd.const_data_ptr<acc_t>(),
            scale.defined() ? scale.const_data_ptr<acc_t>() : nullptr, rstd.numel(), dim, center,
            grad_input.mutable_data_ptr<scalar_t>(), sums.defined() ? sums.mutable_data_ptr<acc_t>() : nullptr);
      };
      const auto with_sums = [&](auto has_scale) {
        if (sums.defined()) {
          run(has_scale, std::true_type());
        } else {
          run(has_scale, std::false_type());
        }
      };
      if (scale.defined()) {
        with_sums(std::true_type());
      } else {
        with_sums(std::false_type());
      }
    });
  });
}

// One row at a time, 64 columns a step: a step without a zero (nearly all) is one vectorized min of the bits but
// the sign (0 for +0 and -0 alone); a step with one takes the row's next slots in column order.
template <typename T>
void gated_exceptions_kernel(const T* act, const T* up, int64_t up_row_stride, int64_t rows, int64_t cols,
                             int64_t slots, int32_t* columns, T* up_at) {
  using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
  static_assert(sizeof(Bits) == sizeof(T));
  constexpr Bits kMagnitude = static_cast<Bits>(~Bits(0) >> 1);
  constexpr int64_t kStep = 64;
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Bits* a = reinterpret_cast<const Bits*>(act + r * cols);
      int32_t* found = columns + r * slots;
      T* kept = up_at + r * slots;
      int64_t n = 0;
      for (int64_t c0 = 0; c0 < cols && n < slots; c0 += kStep) {
        const int64_t stop = std::min(cols, c0 + kStep);
        Bits smallest = kMagnitude;  // a min reduction: vectorized
        for (int64_t c = c0; c < stop; ++c) smallest = std::min<Bits>(smallest, a[c] & kMagnitude);
        for (int64_t c = c0; smallest == 0 && c < stop && n < slots; ++c) {
          if ((a[c] & kMagnitude) == 0) {
            found[n] = static_cast<int32_t>(c);
            kept[n++] = up[r * up_row_stride + c];
          }
        }
      }
      for (; n < slots; ++n) {
        found[n] = -1;
        kept[n] = T(0);
      }
    }
  });
}

void gated_exceptions(const at::Tensor& act, const at::Tensor& up, at::Tensor& columns, at::Tensor& up_at) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, act.scalar_type(), "gated_exceptions", [&] {
    gated_exceptions_kernel<scalar_t>(act.const_data_ptr<scalar_t>(), up.const_data_ptr<scalar_t>(), up.stride(0),
                                      up.size(0), up.size(1), columns.size(1), columns.mutable_data_ptr<int32_t>(),
                                      up_at.mutable_data_ptr<scalar_t>());
  });
}

// The gate gradient at the forward's exceptions (gated_exceptions), which the kernel took up = 0 at.
template <Activation kKind, typename T>
void gated_exceptions_backward(const T* grad, const T* gate, const int32_t* columns, const T* up_at, int64_t rows,
                               int64_t slots, int64_t cols, T* grad_gate) {
  using acc_t = at::opmath_type<T>;
  at::parallel_for(0, rows, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t s = 0; s < slots && columns[r * slots + s] >= 0; ++s) {
        const int64_t e = r * cols + columns[r * slots + s];
        grad_gate[e] = static_cast<T>(exception_grad_gate<kKind, CpuMath>(
            static_cast<acc_t>(grad[e]), static_cast<acc_t>(gate[e]), static_cast<acc_t>(up_at[r * slots + s])));
      }
    }
  });
}

void gated_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& second, const at::Tensor& act,
                    const at::Tensor& columns, const at::Tensor& up_at, Activation kind, at::Tensor& grad_gate,
                    at::Tensor& grad_up) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "gated_backward", [&] {
    dispatch_activation(kind, [&](auto activation) {
      constexpr Activation kKind = decltype(activation)::value;
      const scalar_t *g = grad.const_data_ptr<scalar_t>(), *x = gate.const_data_ptr<scalar_t>(),
                     *s = second.const_data_ptr<scalar_t>();
      scalar_t *dg = grad_gate.mutable_data_ptr<scalar_t>(), *du = grad_up.mutable_data_ptr<scalar_t>();
      const auto run = [&](auto recover) {
        constexpr bool kRecoverUp = decltype(recover)::value;
        const scalar_t* a = kRecoverUp ? act.const_data_ptr<scalar_t>() : nullptr;
        if constexpr (std::is_same_v<scalar_t, at::opmath_type<scalar_t>>) {
          gated_backward_kernel<kKind, kRecoverUp>(g, x, s, a, grad.numel(), dg, du);
        } else {
          gated_backward_reduced_kernel<kKind, kRecoverUp>(g, x, s, a, grad.numel(), dg, du);
        }
      };
      if (act.defined()) {
        run(std::true_type());
      } else {
        run(std::false_type());
      }
      if (columns.defined() && columns.numel() > 0) {
        gated_exceptions_backward<kKind>(g, x, columns.const_data_ptr<int32_t>(), up_at.const_data_ptr<scalar_t>(),
                                         columns.size(0), columns.size(1), grad.dim() ? grad.size(-1) : 1, dg);
      }
    });
  });
}

void affine_weight_grad(const at::Tensor& product, const at::Tensor& total, const at::Tensor& scale,
                        const at::Tensor& shift, at::Tensor& out) {
  const int64_t rows = product.size(0), cols = product.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "affine_weight_grad", [&] {
    using O = scalar_t;
    using acc_t = at::opmath_type<O>;
    const acc_t* scales = scale.defined() ? scale.const_data_ptr<acc_t>() : nullptr;
    const acc_t* shifts = shift.defined() ? shift.const_data_ptr<acc_t>() : nullptr;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, product.scalar_type(), "affine_weight_grad", [&] {
      const scalar_t* in = product.const_data_ptr<scalar_t>();
      const scalar_t* sums = total.defined() ? total.const_data_ptr<scalar_t>() : nullptr;
      O* result = out.mutable_data_ptr<O>();
      at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)), [&](int64_t begin,
                                                                                               int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const acc_t sum = sums ? static_cast<acc_t>(sums[r]) : acc_t(0);
          for (int64_t c = 0; c < cols; ++c) {
            acc_t value = static_cast<acc_t>(in[r * cols + c]);
            if (scales) value *= scales[c];
            if (shifts) value += sum * shifts[c];
            result[r * cols + c] = static_cast<O>(value);
          }
        }
      });
    });
  });
}

PhiloxSeed philox_seed(const at::Tensor& seed) {
  const int64_t* values = seed.const_data_ptr<int64_t>();  // on the CPU: read here, no operator called
  PhiloxSeed out;
  out.key = static_cast<uint64_t>(values[0]);
  out.first = seed.numel() > 1 ? static_cast<uint64_t>(values[1]) : 0;
  return out;
}

void dropout(const at::Tensor& x, double p, const PhiloxSeed& seed, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dropout", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dropout_kernel(x.const_data_ptr<scalar_t>(), x.numel(), seed, dropout_threshold(p),
                   static_cast<acc_t>(1.0 / (1.0 - p)), out.mutable_data_ptr<scalar_t>());
  });
}

void dropout_input_and_grad(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, const at::Tensor& grad,
                            double p, const PhiloxSeed& seed, at::Tensor& read, at::Tensor& masked) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "dropout_input_and_grad", [&] {
    using T = scalar_t;
    using acc_t = at::opmath_type<T>;
    const acc_t* scales = scale.defined() ? scale.const_data_ptr<acc_t>() : nullptr;
    const acc_t* shifts = shift.defined() ? shift.const_data_ptr<acc_t>() : nullptr;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dropout_input_and_grad", [&] {
      dropout_pair_kernel<scalar_t, T>(x.const_data_ptr<scalar_t>(), scales, shifts, x.size(-1),
                                       grad.const_data_ptr<T>(), grad.numel(), seed, dropout_threshold(p),
                                       static_cast<acc_t>(1.0 / (1.0 - p)), read.mutable_data_ptr<T>(),
                                       masked.mutable_data_ptr<T>());
    });
  });
}

PhiloxSeed dropout_draw(const at::Tensor& x, double p, at::Tensor& out) {
  auto* generator = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  PhiloxSeed seed;
  {
    std::lock_guard<std::mutex> lock(generator->mutex_);
    seed.key = generator->random64();
  }
  if (x.numel() > 0) dropout(x, p, seed, out);
  return seed;
}

// `run` on the logits' data, typed by their dtype (fp32, bf16, fp16).
template <typename Run>
void on_logit_rows(const char* op, const at::Tensor& logits, Run run) {
  switch (logits.scalar_type()) {
    case at::kFloat:
      return run(logits.data_ptr<float>());
    case at::kBFloat16:
      return run(logits.data_ptr<at::BFloat16>());
    case at::kHalf:
      return run(logits.data_ptr<at::Half>());
    default:
      TORCH_CHECK_VALUE(false, op, ": unsupported logits dtype ", logits.scalar_type());
  }
}

void cross_entropy_grad(at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, double label_smoothing,
                        double softcap, const at::Tensor& row_scale, at::Tensor& loss) {
  const float* scales = row_scale.defined() ? row_scale.const_data_ptr<float>() : nullptr;
  on_logit_rows("cross_entropy_grad", logits, [&](auto* rows) {
    cross_entropy_rows(rows, target.const_data_ptr<int64_t>(), ignore_index, logits.size(0), logits.size(1),
                       static_cast<float>(label_smoothing), static_cast<float>(softcap), scales,
                       loss.mutable_data_ptr<float>());
  });
}

void token_log_probs(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, double temperature,
                     at::Tensor& log_prob, at::Tensor& entropy, at::Tensor& lse) {
  on_logit_rows("token_log_probs", logits, [&](auto* rows) {
    token_log_probs_rows(rows, target.const_data_ptr<int64_t>(), ignore_index, logits.size(0), logits.size(1),
                         static_cast<float>(temperature), log_prob.mutable_data_ptr<float>(),
                         entropy.mutable_data_ptr<float>(), lse.mutable_data_ptr<float>());
  });
}

void token_log_probs_grad(at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                          const at::Tensor& entropy, const at::Tensor& grad_log_prob, const at::Tensor& grad_entropy,
                          int64_t ignore_index, double temperature) {
  on_logit_rows("token_log_probs_grad_", logits, [&](auto* rows) {
    token_log_probs_grad_rows(rows, target.const_data_ptr<int64_t>(), ignore_index, logits.size(0), logits.size(1),
                              static_cast<float>(temperature), lse.const_data_ptr<float>(),
                              entropy.const_data_ptr<float>(), grad_log_prob.const_data_ptr<float>(),
                              grad_entropy.defined() ? grad_entropy.const_data_ptr<float>() : nullptr);
  });
}

}  // namespace lowmem
