/* Which instruction sets this build of the library uses: the kernels pick their vector routes when compiled
   (-march=native), so this tells which routes a call takes. */
#include "common.h"

/* Bits: 1 AVX-512F, 2 AVX2, 4 FMA, 8 F16C. */
int poot_features(void) {
    int bits = 0;
#ifdef __AVX512F__
    bits |= 1;
#endif
#ifdef __AVX2__
    bits |= 2;
#endif
#ifdef __FMA__
    bits |= 4;
#endif
#ifdef __F16C__
    bits |= 8;
#endif
    return bits;
}
