/* json_simd: simdjson's DOM parser behind a C function, one parser per thread (bench_json only). */
#include "json_simd.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include <simdjson.h>

namespace {

/* Documents above this leave the thread's parser and buffer released after
 * their parse: a worker that once saw a 100 MB document does not keep
 * several times that for the rest of its life. */
constexpr size_t KEEP_CAPACITY = 1 << 20;

struct simd_state {
	simdjson::dom::parser parser;
	uint8_t *buf = nullptr;
	size_t cap = 0; /* bytes of buf, padding included */
	size_t depth = 0; /* the parser's max_depth once allocated */

	~simd_state() { std::free(buf); }

	void release()
	{
		std::free(buf);
		buf = nullptr;
		cap = 0;
		parser = simdjson::dom::parser();
		depth = 0;
	}
};

thread_local simd_state state;

int valid(const uint8_t *p, size_t n, unsigned max_depth)
{
	simd_state &s = state;

	if (n > simdjson::SIMDJSON_MAXSIZE_BYTES)
		return 0;
	if (s.cap < n + simdjson::SIMDJSON_PADDING) {
		size_t want = n + simdjson::SIMDJSON_PADDING;
		if (want < 4096)
			want = 4096;
		std::free(s.buf);
		s.buf = static_cast<uint8_t *>(std::malloc(want));
		s.cap = s.buf ? want : 0;
		if (!s.buf)
			return 0;
	}
	/* The parser keeps its max_depth across the reallocations parse()
	 * makes; set it (and a first capacity) once. */
	if (s.depth != max_depth) {
		if (s.parser.allocate(n < 4096 ? 4096 : n, max_depth) != simdjson::SUCCESS)
			return 0;
		s.depth = max_depth;
	}
	std::memcpy(s.buf, p, n);
	std::memset(s.buf + n, 0, simdjson::SIMDJSON_PADDING);
	/* Stage 2 of the DOM parser builds the whole tape: every string is
	 * unescaped, every number parsed, the UTF-8 of the whole input checked. */
	simdjson::dom::element root;
	simdjson::error_code err = s.parser.parse(s.buf, n, false).get(root);
	if (n > KEEP_CAPACITY)
		s.release();
	return err == simdjson::SUCCESS;
}

} // namespace

extern "C" int ap_json_simd_valid(const uint8_t *p, size_t n, unsigned max_depth)
{
	try {
		return valid(p, n, max_depth);
	} catch (...) {
		/* Nothing here should throw; if it does, the reference
		 * validator judges the document. */
		return 0;
	}
}

extern "C" void ap_json_simd_release(void)
{
	try {
		state.release();
	} catch (...) {
	}
}
