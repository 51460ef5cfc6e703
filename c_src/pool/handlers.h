/* handlers: the built-in handlers (echo, json_validate) and loading .so plugins. */
#ifndef AP_HANDLERS_H
#define AP_HANDLERS_H

#include <stddef.h>
#include <stdint.h>

#include "actor_pool_handler.h"

/* The built-in handler called `name` ("echo", "json_validate"), or NULL.
 * The result is static: never unloaded, never freed. */
const actor_pool_handler *ap_builtin_handler(const char *name);
/* A built-in whose messages may run on the event loop (ap_pool_run_inline):
 * short for a short message, never blocking, thread-agnostic state. */
int ap_handler_may_inline(const actor_pool_handler *h);

/* ---- json_validate ---------------------------------------------------------
 * Strict RFC 8259. The reasons, in the order the handler's reply atoms are
 * named by ap_json_reason_name(). Offsets are 0-based byte offsets:
 *
 *   unexpected_byte        a byte that cannot start or continue the structure
 *                          here (a trailing comma, a missing ':', a '+1', a
 *                          non-ASCII byte outside a string): at that byte
 *   unexpected_end         the document ends where a value, ':', ',', a
 *                          closing bracket or a string's closing quote (or
 *                          the low half of a surrogate pair) is due: at len
 *   invalid_escape         '\' not followed by one of "\/bfnrtu, or \u not
 *                          followed by 4 hex digits: at the first wrong byte
 *                          (len when the escape is cut short)
 *   invalid_utf8           an ill-formed sequence inside a string (a stray
 *                          continuation, an overlong, an encoded surrogate,
 *                          above U+10FFFF, cut short): at its first byte
 *   invalid_number         outside the number grammar (a leading zero, '-'
 *                          or '.' or 'e' without digits): at the first wrong
 *                          byte (len when cut short)
 *   trailing_data          something after the one top-level value: at it
 *   too_deep               the 513th nested '[' or '{': at it
 *   invalid_literal        a 't', 'f' or 'n' that does not spell true, false
 *                          or null: at the first wrong byte (len when cut short)
 *   control_char_in_string an unescaped byte below 0x20 in a string: at it
 *   lone_surrogate         a \uD800-\uDBFF escape not followed by a \uDC00-
 *                          \uDFFF escape, or a \uDC00-\uDFFF escape on its
 *                          own: at the '\' of the lone half
 *
 * A token cut short by the end of the document (a literal, a number, an
 * escape, a UTF-8 sequence) gets the token's own reason, not unexpected_end:
 * the document is as wrong as if another byte stood there.
 */
enum ap_json_result {
	AP_JSON_OK = 0,
	AP_JSON_UNEXPECTED_BYTE,
	AP_JSON_UNEXPECTED_END,
	AP_JSON_INVALID_ESCAPE,
	AP_JSON_INVALID_UTF8,
	AP_JSON_INVALID_NUMBER,
	AP_JSON_TRAILING_DATA,
	AP_JSON_TOO_DEEP,
	AP_JSON_INVALID_LITERAL,
	AP_JSON_CONTROL_CHAR_IN_STRING,
	AP_JSON_LONE_SURROGATE,
};

/* Nesting deeper than this is refused (too_deep): 512 open brackets pass. */
#define AP_JSON_MAX_DEPTH 512

/* Validates p[0..n) in one pass, without allocating. Returns AP_JSON_OK, or
 * the reason and *err_off (untouched on success). */
enum ap_json_result ap_json_validate(const uint8_t *p, size_t n, size_t *err_off);

/* The reply atom for a result ("ok", "unexpected_byte", ...). */
const char *ap_json_reason_name(enum ap_json_result r);

/* ---- plugins ---------------------------------------------------------------
 * Loads the shared object at `path` (RTLD_NOW | RTLD_LOCAL), calls its
 * ACTOR_POOL_HANDLER_SYMBOL and checks the result. `path` is a file path: a
 * name without '/' is looked up in the current directory, not in the
 * library search path.
 *
 * Returns 0 with *out and *dl_handle set (release with ap_plugin_unload
 * after the last worker using *out has terminated);
 *   -1 when it cannot be loaded (no file, not a shared object, unresolved
 *      symbols, no ACTOR_POOL_HANDLER_SYMBOL, the getter returned NULL or a
 *      handler without handle); `why` holds the reason (dlerror's text when
 *      dlopen/dlsym failed);
 *   -2 when its abi_version is not ACTOR_POOL_HANDLER_ABI: *got holds it.
 * On failure *out and *dl_handle are NULL and nothing stays loaded. `why` is
 * always NUL-terminated when why_len > 0; `got` may be NULL.
 *
 * Loading runs the object's constructors: a plugin that crashes in one, or
 * in its getter, takes the node down. Only trusted files can be plugins.
 */
int ap_plugin_load(const char *path, const actor_pool_handler **out, void **dl_handle, uint32_t *got, char *why,
		   size_t why_len);
void ap_plugin_unload(void *dl_handle);

/* Whether `path` (read as ap_plugin_load reads it) names a regular file
 * this process can open for reading, without loading it: what a pool whose
 * workers load the plugin elsewhere (a worker process) checks first.
 * Returns 0, or -1 with `why` ("<path>: <strerror>", "<path>: not a regular
 * file", "empty path"; NUL-terminated when why_len > 0). Never blocks on a
 * FIFO or a device. */
int ap_plugin_check(const char *path, char *why, size_t why_len);

#endif
