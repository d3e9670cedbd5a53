// Tabulate the GPU's approximate exp2 and log2 (the special function unit behind ex2.approx / lg2.approx,
// which flash-attention kernels call for exp2f and __logf) and test how it scales with the input's exponent.
//
// Build and run on the GPU machine (benchmarks/gpu_special_functions.py does both and packs the results):
//   nvcc -O2 -arch=sm_90 -o /tmp/gpu_sf benchmarks/gpu_special_functions.cu && /tmp/gpu_sf OUT_DIR
//
// Writes to OUT_DIR:
//   summary.txt              one line per measurement (key = value), read by the Python driver
//   ex2_frac<F>.i8           ex2.approx.ftz(i * 2^-F), i in [0, 2^F), as bit difference to the correctly
//                            rounded 2^x (int8, saturated at +-127)
//   ex2_neg<E>.i8            ex2.approx.ftz(x) for every fp32 x in [-2^E, -2^(E-1)), bit difference likewise
//   lg2_mant.i16             lg2.approx.ftz(x) - log2(x) for x = 1 + i * 2^-23, in units of 2^-30 (int16)
//   lg2_e10.i8               lg2.approx.ftz(x) for x in [2^10, 2^11), bit difference to the correctly rounded
//   rcp_mant.i8              rcp.approx.ftz(x) for x = 1 + i * 2^-23, bit difference to the correctly rounded 1/x
//                            (part `rcp`: with the law rcp(2^e m) == 2^-e rcp(m), and __fdividef against a * rcp(b))
// The scaling hypotheses: ex2(x) == 2^n * ex2(f) with x * 2^F converted to an integer (floor, nearest, toward
// zero) and split into n and an F-bit fraction f, counted over every fp32 x in [-128, 0].
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CHECK(call)                                                                              \
  do {                                                                                           \
    cudaError_t err_ = (call);                                                                   \
    if (err_ != cudaSuccess) {                                                                   \
      fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, __LINE__); \
      exit(1);                                                                                   \
    }                                                                                            \
  } while (0)

__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float ex2_full(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2_ftz(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// op: 0 ex2.approx.ftz, 1 ex2.approx (denormals kept), 2 exp2f (CUDA's math library), 3 lg2.approx.ftz,
//     4 __logf, 5 logf
__device__ float apply_op(int op, float x) {
  switch (op) {
    case 0: return ex2_ftz(x);
    case 1: return ex2_full(x);
    case 2: return exp2f(x);
    case 3: return lg2_ftz(x);
    case 4: return __logf(x);
    default: return logf(x);
  }
}

__device__ __forceinline__ float cr_exp2_ftz(float x) {
  float r = (float)exp2((double)x);
  return r < FLT_MIN ? 0.f : r;
}

__device__ __forceinline__ int sat(int k, int lim) { return k > lim ? lim : (k < -lim ? -lim : k); }

__global__ void frac_table(int op, int F, int negative, float* T) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (1u << F)) return;
  float x = ldexpf((float)i, -F);
  T[i] = apply_op(op, negative ? -x : x);
}

__global__ void frac_diff(int F, const float* T, int8_t* d) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (1u << F)) return;
  float cr = cr_exp2_ftz(ldexpf((float)i, -F));
  d[i] = (int8_t)sat((int)__float_as_int(T[i]) - (int)__float_as_int(cr), 127);
}

// every fp32 bit pattern in [start, start + n): ex2.approx.ftz's bit difference to the correctly rounded value
__global__ void range_diff(uint32_t start, uint32_t n, int8_t* d) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = __uint_as_float(start + i);
  d[i] = (int8_t)sat((int)__float_as_int(ex2_ftz(x)) - (int)__float_as_int(cr_exp2_ftz(x)), 127);
}

// Blocks of 256 consecutive bit patterns starting at a multiple of 256 never cross a binade: one shared
// counter per block, one global atomic per block.
// mode: 0 floor, 1 nearest-even, 2 toward zero (all with the table of positive fractions);
//       3 toward zero, 4 nearest-even with the table of negative fractions (x = -(n + f), both n, f >= 0)
// hist (optional): per binade, ulp difference to the correctly rounded value in -4..4 (saturated)
__global__ void check_scaling(int op, uint32_t start, uint32_t n, const float* T, int F, int mode,
                              unsigned long long* mism, unsigned long long* hist, uint32_t* ex, unsigned int* nex) {
  __shared__ unsigned int block_mism;
  __shared__ unsigned int block_hist[9];
  if (threadIdx.x == 0) block_mism = 0;
  if (threadIdx.x < 9) block_hist[threadIdx.x] = 0;
  __syncthreads();
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t b = start + i;
  bool live = i < n;
  if (live) {
    float x = __uint_as_float(b);
    float y = apply_op(op, x);
    if (hist) atomicAdd(&block_hist[sat((int)__float_as_int(y) - (int)__float_as_int(cr_exp2_ftz(x)), 4) + 4], 1u);
    double X = (double)x * ldexp(1.0, F);
    float pred;
    if (mode <= 2) {
      double Xr = mode == 0 ? floor(X) : (mode == 1 ? rint(X) : trunc(X));
      long long Xi = (long long)Xr;
      long long nn = Xi >> F;
      long long f = Xi - (nn << F);
      pred = nn < -300 ? 0.f : ldexpf(T[f], (int)nn);
    } else {
      double Xr = mode == 3 ? trunc(-X) : rint(-X);
      long long Xi = (long long)Xr;
      long long nn = Xi >> F;
      long long f = Xi - (nn << F);
      pred = nn > 300 ? 0.f : ldexpf(T[f], -(int)nn);
    }
    if (op != 1 && pred < FLT_MIN) pred = 0.f;
    if (__float_as_uint(pred) != __float_as_uint(y)) {
      atomicAdd(&block_mism, 1u);
      unsigned int k = *(volatile unsigned int*)nex < 64 ? atomicAdd(nex, 1u) : 64u;
      if (k < 64) {
        ex[2 * k] = b;
        ex[2 * k + 1] = __float_as_uint(y);
      }
    }
  }
  __syncthreads();
  uint32_t binade = ((start + blockIdx.x * blockDim.x) >> 23) & 0xff;
  if (threadIdx.x == 0 && block_mism) atomicAdd(&mism[binade], (unsigned long long)block_mism);
  if (hist && threadIdx.x < 9 && block_hist[threadIdx.x])
    atomicAdd(&hist[binade * 9 + threadIdx.x], (unsigned long long)block_hist[threadIdx.x]);
}

// two ops on the same inputs: elements whose bits differ (per binade)
__device__ void count_block(bool hit, unsigned long long* counter) {
  __shared__ unsigned int block_count;
  if (threadIdx.x == 0) block_count = 0;
  __syncthreads();
  if (hit) atomicAdd(&block_count, 1u);
  __syncthreads();
  if (threadIdx.x == 0 && block_count) atomicAdd(counter, (unsigned long long)block_count);
}

__global__ void compare_ops(int op_a, int op_b, uint32_t start, uint32_t n, unsigned long long* mism) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  float x = __uint_as_float(start + i);
  bool hit = i < n && __float_as_uint(apply_op(op_a, x)) != __float_as_uint(apply_op(op_b, x));
  count_block(hit, &mism[((start + blockIdx.x * blockDim.x) >> 23) & 0xff]);
}

// __logf against lg2.approx.ftz(x) * ln 2 in fp32 (what the fast-math intrinsic is documented to be)
__global__ void logf_vs_lg2(uint32_t start, uint32_t n, unsigned long long* mism) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  float x = __uint_as_float(start + i);
  float want = __fmul_rn(lg2_ftz(x), 0.69314718055994530942f);
  count_block(i < n && __float_as_uint(__logf(x)) != __float_as_uint(want), mism);
}

// CUDA's accurate logf (what an unfused kernel's log calls) against the correctly rounded natural log
__global__ void logf_vs_cr(uint32_t start, uint32_t n, unsigned long long* mism) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  float x = __uint_as_float(start + i);
  count_block(i < n && __float_as_uint(logf(x)) != __float_as_uint((float)log((double)x)), mism);
}

__global__ void lg2_mant(int16_t* d) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (1u << 23)) return;
  float x = __uint_as_float(0x3f800000u + i);
  double err = ((double)lg2_ftz(x) - log2((double)x)) * 1073741824.0;
  d[i] = (int16_t)fmax(-32767.0, fmin(32767.0, rint(err)));
}

__global__ void lg2_e10(int8_t* d, unsigned long long* mism_scaled, const float* lg2_m) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (1u << 23)) return;
  float x = __uint_as_float(0x44800000u + i);  // 2^10 * (1 + i 2^-23)
  float y = lg2_ftz(x);
  float cr = (float)log2((double)x);
  d[i] = (int8_t)sat((int)__float_as_int(y) - (int)__float_as_int(cr), 127);
  count_block(__float_as_uint(y) != __float_as_uint(__fadd_rn(10.0f, lg2_m[i])), mism_scaled);
}

__global__ void lg2_table(float* T) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (1u << 23)) return;
  T[i] = lg2_ftz(__uint_as_float(0x3f800000u + i));
}


// lg2.approx.ftz on [1, 2): its bits as an int32 difference to the correctly rounded log2 (exact table)
__global__ void lg2_table_diff(int32_t* d) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (1u << 23)) return;
  float x = __uint_as_float(0x3f800000u + i);
  d[i] = (int32_t)__float_as_int(lg2_ftz(x)) - (int32_t)__float_as_int((float)log2((double)x));
}

// the law lg2(2^e m) == RZ_fp32(e + lg2(m)) for e in [1, 126], every mantissa; lg2_m the table on [1, 2)
__global__ void lg2_law(int e, const float* lg2_m, unsigned long long* mism) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  float x = __uint_as_float(((uint32_t)(127 + e) << 23) + i);
  float want = __double2float_rz((double)e + (double)lg2_m[i]);
  count_block(i < (1u << 23) && __float_as_uint(lg2_ftz(x)) != __float_as_uint(want), mism);
}

// the law ex2(x) == 2^n T+[f] for every fp32 x in (0, 128), |x| 2^23 truncated (Tp: ex2 at +i 2^-23)
__global__ void ex2_positive_law(uint32_t start, uint32_t n, const float* Tp, unsigned long long* mism) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  float x = __uint_as_float(start + i);
  long long X = (long long)trunc((double)x * 8388608.0);
  long long nn = X >> 23, f = X & 8388607;
  float pred = ldexpf(Tp[f], (int)nn);
  count_block(i < n && __float_as_uint(pred) != __float_as_uint(ex2_ftz(x)),
              &mism[((start + blockIdx.x * blockDim.x) >> 23) & 0xff]);
}

// expf / logf (CUDA's accurate ones) per input binade: how many differ from the correctly rounded value, and a
// checksum of their bits (sum of bits times position, mod 2^64) to compare with an emulation bit for bit
__global__ void accurate_fn_census(int op, uint32_t start, uint32_t n, unsigned long long* mism,
                                   unsigned long long* sum) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  float x = __uint_as_float(start + i);
  float y = op == 0 ? expf(x) : logf(x);
  float cr = op == 0 ? (float)exp((double)x) : (float)log((double)x);
  uint32_t binade = ((start + blockIdx.x * blockDim.x) >> 23) & 0x1ff;
  bool live = i < n;
  count_block(live && __float_as_uint(y) != __float_as_uint(cr), &mism[binade]);
  unsigned long long term = live ? (unsigned long long)__float_as_uint(y) * (unsigned long long)(start + i) : 0ull;
  for (int off = 16; off > 0; off >>= 1) term += __shfl_down_sync(0xffffffffu, term, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(&sum[binade], term);
}

// rcp.approx.ftz on [1, 2): its bits as a difference to the correctly rounded reciprocal (saturated int8)
__global__ void rcp_mant(int8_t* d) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (1u << 23)) return;
  float x = __uint_as_float(0x3f800000u + i);
  d[i] = (int8_t)sat((int)__float_as_int(rcp_ftz(x)) - (int)__float_as_int(__frcp_rn(x)), 127);
}

// the law rcp(2^e m) == 2^-e rcp(m) for every mantissa m of [1, 2), e in [-125, 125] (normal results)
__global__ void rcp_law(int e, unsigned long long* mism) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  float m = __uint_as_float(0x3f800000u + i);
  float x = ldexpf(m, e);
  count_block(i < (1u << 23) && __float_as_uint(rcp_ftz(x)) != __float_as_uint(ldexpf(rcp_ftz(m), -e)), mism);
}

// __fdividef(a, b) against a * rcp.approx(b) and against the correctly rounded a / b, on pairs from a hash
__global__ void fdividef_check(uint32_t n, unsigned long long* mism_rcp, unsigned long long* mism_rn) {
  uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t h = i * 2654435761u;
  float a = __uint_as_float(0x3c000000u + (h & 0x03ffffffu));                 // about [2^-7, 2^1)
  float b = __uint_as_float(0x3f800000u + ((h * 2246822519u) & 0x067fffffu));  // about [1, 2^13): row sums
  float q = __fdividef(a, b);
  count_block(i < n && __float_as_uint(q) != __float_as_uint(__fmul_rn(a, rcp_ftz(b))), mism_rcp);
  count_block(i < n && __float_as_uint(q) != __float_as_uint(__fdiv_rn(a, b)), mism_rn);
}

static void write_file(const std::string& path, const void* host, size_t bytes) {
  FILE* f = fopen(path.c_str(), "wb");
  if (!f || fwrite(host, 1, bytes, f) != bytes) {
    fprintf(stderr, "cannot write %s\n", path.c_str());
    exit(1);
  }
  fclose(f);
}

static unsigned blocks(uint64_t n) { return (unsigned)((n + 255) / 256); }

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    fprintf(stderr, "usage: %s OUT_DIR [all|tables|laws|rcp]\n", argv[0]);
    return 2;
  }
  std::string out = argv[1];
  std::string part = argc == 3 ? argv[2] : "all";
  if (part != "all" && part != "tables" && part != "laws" && part != "rcp") {
    fprintf(stderr, "usage: %s OUT_DIR [all|tables|laws|rcp] (not %s)\n", argv[0], part.c_str());
    return 2;
  }
  bool tables = part == "all" || part == "tables", laws = part == "all" || part == "laws";
  bool rcp = part == "all" || part == "rcp";
  FILE* summary = fopen((out + "/summary.txt").c_str(), "w");
  if (!summary) {
    fprintf(stderr, "cannot write %s/summary.txt\n", out.c_str());
    return 1;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  fprintf(summary, "device = %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);

  const uint32_t neg_start = 0x80000000u;           // -0.0
  const uint32_t neg_end = 0xC3000000u;             // -128.0 (exclusive of larger magnitudes)
  const uint32_t neg_n = neg_end - neg_start + 1u;  // every fp32 in [-128, -0]

  float *T, *Tn;
  int8_t* d8;
  unsigned long long *mism, *hist;
  uint32_t* ex;
  unsigned int* nex;
  CHECK(cudaMalloc(&T, sizeof(float) << 24));
  CHECK(cudaMalloc(&Tn, sizeof(float) << 24));
  CHECK(cudaMalloc(&d8, 1u << 24));
  CHECK(cudaMalloc(&mism, 256 * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&hist, 256 * 9 * sizeof(unsigned long long)));
  CHECK(cudaMalloc(&ex, 128 * sizeof(uint32_t)));
  CHECK(cudaMalloc(&nex, sizeof(unsigned int)));
  std::vector<unsigned long long> h_m(256), h_h(256 * 9);
  std::vector<uint32_t> h_ex(128);
  std::vector<int8_t> h_d8(1u << 24);

  if (tables) {
  // 1. the error profile of ex2.approx.ftz over [-128, 0], per binade
  // 2. the scaling hypotheses
  for (int F = 22; F <= 24; ++F) {
    frac_table<<<blocks(1ull << F), 256>>>(0, F, 0, T);
    frac_table<<<blocks(1ull << F), 256>>>(0, F, 1, Tn);
    CHECK(cudaGetLastError());
    if (F >= 23) {
      frac_diff<<<blocks(1ull << F), 256>>>(F, T, d8);
      CHECK(cudaMemcpy(h_d8.data(), d8, 1u << F, cudaMemcpyDeviceToHost));
      write_file(out + "/ex2_frac" + std::to_string(F) + ".i8", h_d8.data(), 1u << F);
    }
    for (int mode = 0; mode < 5; ++mode) {
      bool with_hist = F == 23 && mode == 0;
      CHECK(cudaMemset(mism, 0, 256 * sizeof(unsigned long long)));
      CHECK(cudaMemset(hist, 0, 256 * 9 * sizeof(unsigned long long)));
      CHECK(cudaMemset(nex, 0, sizeof(unsigned int)));
      check_scaling<<<blocks(neg_n), 256>>>(0, neg_start, neg_n, mode <= 2 ? T : Tn, F, mode, mism,
                                            with_hist ? hist : nullptr, ex, nex);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(h_m.data(), mism, 256 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(h_ex.data(), ex, 128 * sizeof(uint32_t), cudaMemcpyDeviceToHost));
      unsigned long long total = 0;
      for (int e = 0; e < 256; ++e) total += h_m[e];
      fprintf(summary, "scaling F=%d mode=%d mismatches = %llu of %u\n", F, mode, total, neg_n);
      fprintf(summary, "scaling F=%d mode=%d per_binade =", F, mode);
      for (int e = 0; e < 256; ++e)
        if (h_m[e]) fprintf(summary, " %d:%llu", e - 127, h_m[e]);
      fprintf(summary, "\nscaling F=%d mode=%d examples =", F, mode);
      for (int k = 0; k < 16 && k < (int)total; ++k) fprintf(summary, " %08x:%08x", h_ex[2 * k], h_ex[2 * k + 1]);
      fprintf(summary, "\n");
      if (with_hist) {
        CHECK(cudaMemcpy(h_h.data(), hist, 256 * 9 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        for (int e = 0; e < 256; ++e) {
          unsigned long long s = 0;
          for (int j = 0; j < 9; ++j) s += h_h[e * 9 + j];
          if (!s) continue;
          fprintf(summary, "ex2 ulp_hist binade=%d =", e - 127);
          for (int j = 0; j < 9; ++j) fprintf(summary, " %llu", h_h[e * 9 + j]);
          fprintf(summary, "\n");
        }
      }
      fflush(summary);
    }
  }

  // 3. whole binades of negative inputs, for fitting offline
  for (int E : {-1, 0, 1, 3, 5}) {
    uint32_t start = 0x80000000u | ((uint32_t)(127 + E - 1) << 23);  // -2^(E-1): the binade [-2^E, -2^(E-1))
    range_diff<<<blocks(1u << 23), 256>>>(start, 1u << 23, d8);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(h_d8.data(), d8, 1u << 23, cudaMemcpyDeviceToHost));
    write_file(out + "/ex2_neg" + std::to_string(E) + ".i8", h_d8.data(), 1u << 23);
  }

  // 4. other exp2 entry points against ex2.approx.ftz over [-126, 0] (normal results)
  const uint32_t normal_end = 0xC2FC0000u;  // -126.0
  for (int op : {1, 2}) {
    CHECK(cudaMemset(mism, 0, 256 * sizeof(unsigned long long)));
    compare_ops<<<blocks((uint64_t)(normal_end - neg_start) + 1), 256>>>(0, op, neg_start, normal_end - neg_start + 1,
                                                                       mism);
    CHECK(cudaMemcpy(h_m.data(), mism, 256 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    unsigned long long total = 0;
    for (int e = 0; e < 256; ++e) total += h_m[e];
    fprintf(summary, "compare op0 op%d over [-126,0] mismatches = %llu\n", op, total);
  }

  // 5. log2 and the log the kernels take of the row sum
  int16_t* d16;
  CHECK(cudaMalloc(&d16, sizeof(int16_t) << 23));
  lg2_mant<<<blocks(1u << 23), 256>>>(d16);
  std::vector<int16_t> h_d16(1u << 23);
  CHECK(cudaMemcpy(h_d16.data(), d16, sizeof(int16_t) << 23, cudaMemcpyDeviceToHost));
  write_file(out + "/lg2_mant.i16", h_d16.data(), sizeof(int16_t) << 23);
  lg2_table<<<blocks(1u << 23), 256>>>(T);
  CHECK(cudaMemset(mism, 0, sizeof(unsigned long long)));
  lg2_e10<<<blocks(1u << 23), 256>>>(d8, mism, T);
  CHECK(cudaMemcpy(h_d8.data(), d8, 1u << 23, cudaMemcpyDeviceToHost));
  write_file(out + "/lg2_e10.i8", h_d8.data(), 1u << 23);
  CHECK(cudaMemcpy(h_m.data(), mism, sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  fprintf(summary, "lg2 e10 == fp32(10 + lg2(mantissa)) mismatches = %llu of %u\n", h_m[0], 1u << 23);
  const uint32_t one = 0x3f800000u, big = 0x46000000u;  // [1, 8192): row sums of up to 8192 keys
  CHECK(cudaMemset(mism, 0, sizeof(unsigned long long)));
  logf_vs_lg2<<<blocks(big - one), 256>>>(one, big - one, mism);
  CHECK(cudaMemcpy(h_m.data(), mism, sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  fprintf(summary, "__logf == fp32(lg2.approx.ftz * ln2) over [1,8192) mismatches = %llu of %u\n", h_m[0], big - one);
  CHECK(cudaMemset(mism, 0, sizeof(unsigned long long)));
  logf_vs_cr<<<blocks(big - one), 256>>>(one, big - one, mism);
  CHECK(cudaMemcpy(h_m.data(), mism, sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  fprintf(summary, "logf == correctly rounded log over [1,8192) mismatches = %llu of %u\n", h_m[0], big - one);
  }  // tables

  if (laws) {
    // 6a. the exact lg2 table on [1, 2) and the law that scales it
    int32_t* d32;
    CHECK(cudaMalloc(&d32, sizeof(int32_t) << 23));
    lg2_table_diff<<<blocks(1u << 23), 256>>>(d32);
    std::vector<int32_t> h_d32(1u << 23);
    CHECK(cudaMemcpy(h_d32.data(), d32, sizeof(int32_t) << 23, cudaMemcpyDeviceToHost));
    write_file(out + "/lg2_exact.i32", h_d32.data(), sizeof(int32_t) << 23);
    lg2_table<<<blocks(1u << 23), 256>>>(T);
    unsigned long long law_total = 0;
    fprintf(summary, "lg2 law RZ(e + lg2(m)) per_e =");
    for (int e = 1; e <= 126; ++e) {
      CHECK(cudaMemset(mism, 0, sizeof(unsigned long long)));
      lg2_law<<<blocks(1u << 23), 256>>>(e, T, mism);
      CHECK(cudaMemcpy(h_m.data(), mism, sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      law_total += h_m[0];
      if (h_m[0]) fprintf(summary, " %d:%llu", e, h_m[0]);
    }
    fprintf(summary, "\nlg2 law RZ(e + lg2(m)) e=1..126 mismatches = %llu of %llu\n", law_total, 126ull << 23);
    // 6b. ex2 on positive inputs: every fp32 in [0, 128)
    frac_table<<<blocks(1u << 23), 256>>>(0, 23, 0, T);
    CHECK(cudaMemset(mism, 0, 256 * sizeof(unsigned long long)));
    const uint32_t pos_end = 0x43000000u;  // 128.0
    ex2_positive_law<<<blocks(pos_end), 256>>>(0, pos_end, T, mism);
    CHECK(cudaMemcpy(h_m.data(), mism, 256 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    unsigned long long pos_total = 0;
    for (int e = 0; e < 256; ++e) pos_total += h_m[e];
    fprintf(summary, "ex2 positive law over [0,128) mismatches = %llu of %u\n", pos_total, pos_end);
    // 6c/d. CUDA's accurate expf over [-104, 89] and logf over (0, inf): per binade, census and checksum
    unsigned long long *cm, *cs;
    CHECK(cudaMalloc(&cm, 512 * sizeof(unsigned long long)));
    CHECK(cudaMalloc(&cs, 512 * sizeof(unsigned long long)));
    std::vector<unsigned long long> h_cm(512), h_cs(512);
    struct Range { int op; uint32_t start, end; const char* name; };
    const Range ranges[] = {{0, 0x80000000u, 0xC2D00000u, "expf_neg"}, {0, 0x00000000u, 0x42B20000u, "expf_pos"},
                            {1, 0x00800000u, 0x7F800000u, "logf"}};
    for (const Range& r : ranges) {
      CHECK(cudaMemset(cm, 0, 512 * sizeof(unsigned long long)));
      CHECK(cudaMemset(cs, 0, 512 * sizeof(unsigned long long)));
      accurate_fn_census<<<blocks((uint64_t)(r.end - r.start)), 256>>>(r.op, r.start, r.end - r.start, cm, cs);
      CHECK(cudaGetLastError());
      CHECK(cudaMemcpy(h_cm.data(), cm, 512 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(h_cs.data(), cs, 512 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      for (int b = 0; b < 512; ++b)
        if (h_cs[b] || h_cm[b]) fprintf(summary, "census %s binade=%d mismatches=%llu checksum=%llu\n", r.name, b,
                                        h_cm[b], h_cs[b]);
    }
    fflush(summary);
  }  // laws

  if (rcp) {
    // 7. the reciprocal a kernel's epilogue may take of the row sum (rcp.approx, MUFU.RCP): its table on [1, 2),
    //    the law that scales it, and __fdividef
    rcp_mant<<<blocks(1u << 23), 256>>>(d8);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(h_d8.data(), d8, 1u << 23, cudaMemcpyDeviceToHost));
    write_file(out + "/rcp_mant.i8", h_d8.data(), 1u << 23);
    unsigned long long rcp_total = 0;
    fprintf(summary, "rcp law 2^-e rcp(m) per_e =");
    for (int e = -125; e <= 125; ++e) {
      CHECK(cudaMemset(mism, 0, sizeof(unsigned long long)));
      rcp_law<<<blocks(1u << 23), 256>>>(e, mism);
      CHECK(cudaMemcpy(h_m.data(), mism, sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      rcp_total += h_m[0];
      if (h_m[0]) fprintf(summary, " %d:%llu", e, h_m[0]);
    }
    fprintf(summary, "\nrcp law e=-125..125 mismatches = %llu of %llu\n", rcp_total, 251ull << 23);
    const uint32_t pairs = 1u << 26;
    CHECK(cudaMemset(mism, 0, 2 * sizeof(unsigned long long)));
    fdividef_check<<<blocks(pairs), 256>>>(pairs, mism, mism + 1);
    CHECK(cudaMemcpy(h_m.data(), mism, 2 * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    fprintf(summary, "__fdividef == a * rcp.approx(b) mismatches = %llu of %u\n", h_m[0], pairs);
    fprintf(summary, "__fdividef == correctly rounded a / b mismatches = %llu of %u\n", h_m[1], pairs);
    fflush(summary);
  }  // rcp
  CHECK(cudaDeviceSynchronize());
  fprintf(summary, "done = 1\n");
  fclose(summary);
  return 0;
}
