// The sampler's draw on CPU: one token per row from its (unnormalised) probabilities and one uniform, by the
// inverse of the row's cumulative distribution (sample/cpu_draw.py says why this and not the exponential race).
//
// The result is defined as torch's `searchsorted(probs.cumsum(-1, dtype=float64), u * total, right=True)`: the
// first index whose running float64 sum, added in vocabulary order, exceeds u times the row's whole sum. The
// kernel adds in the same order, so it gives the same index (sample/cpu_draw.py's torch path is the reference the
// tests compare it with). One pass sums the row and keeps the running sum at every kStride-th entry; the second
// finds the stride the target falls in from those and replays the sum within it: ~1.0 reads of the row, not 2.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kStride = 256;

// The first index of the row's largest value (torch.argmax's choice among ties); NaN counts as the largest,
// as in torch. For rows whose draw has no answer: every probability 0, a NaN, or u * total rounded up to total.
int64_t first_max(const float* p, int vocab) {
    int64_t best = 0;
    for (int j = 0; j < vocab; ++j) {
        if (p[j] != p[j]) return j;
        if (p[j] > p[best]) best = j;
    }
    return best;
}

int64_t draw_row(const float* p, int vocab, double u, std::vector<double>& ends) {
    const int strides = (vocab + kStride - 1) / kStride;
    ends.resize(strides);
    double total = 0.0;
    for (int s = 0; s < strides; ++s) {
        const int end = std::min(vocab, (s + 1) * kStride);
        for (int j = s * kStride; j < end; ++j) total += static_cast<double>(p[j]);
        ends[s] = total;
    }
    const double target = u * total;
    int s = 0;
    while (s < strides && !(ends[s] > target)) ++s;
    if (s == strides) return first_max(p, vocab);
    double run = s > 0 ? ends[s - 1] : 0.0;
    const int end = std::min(vocab, (s + 1) * kStride);
    for (int j = s * kStride; j < end; ++j) {
        run += static_cast<double>(p[j]);
        if (run > target) return j;
    }
    return end - 1;  // unreachable: the replay reaches ends[s] > target by the stride's end
}

}  // namespace

extern "C" {

// probs [rows, vocab], rows ld floats apart, each >= 0; u [rows], each in [0, 1); out [rows].
void sluice_sample_inverse_cdf_f32(const float* probs, int64_t ld, int rows, int vocab, const double* u, int64_t* out,
                                   int threads) {
#pragma omp parallel num_threads(threads) if (rows > 1 && threads > 1)
    {
        std::vector<double> ends;
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < rows; ++r) out[r] = draw_row(probs + r * ld, vocab, u[r], ends);
    }
}

}  // extern "C"
