/* t_fuzz: what the fuzz targets share. A failed check names its file and
 * line and traps: libFuzzer keeps the input that did it. */
#ifndef T_FUZZ_H
#define T_FUZZ_H

#include <stdio.h>

#define t_check(cond)                                                                             \
	do {                                                                                      \
		if (!(cond)) {                                                                    \
			fprintf(stderr, "%s: check failed line %d: %s\n", __FILE__, __LINE__, #cond); \
			__builtin_trap();                                                         \
		}                                                                                 \
	} while (0)

#endif
