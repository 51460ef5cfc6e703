/* fuzz_rcpt_proto: libFuzzer target over the receptionist's protocol
 * decoder (receptionist/rcpt_proto.c): what the process actor_receptionist
 * makes of the messages and calls any peer holding the cookie can send it.
 *
 * rcpt_proto.c is compiled into this file so that the registry it owns can
 * be checked whole (registry_check) after each input; nothing of it is
 * changed. The process runs on a real node without connections, and gets
 * each message as the runtime hands it over (test/t_rcpt.h: the message
 * refused unless it is one whole term, then ap_node_classify, then the
 * process's function); what it sends is caught at link time.
 *
 * Input: byte 0 picks the listing limit (bit 0: 64 bytes, so that
 * too_many_refs is reached; else the default), then messages, each two
 * bytes of length (big-endian) and that many bytes of one term without its
 * version byte (cut short at the end of the input). Each input starts on a
 * fresh registry, so a finding replays from its file alone.
 *
 * Checked, beyond t_rcpt.h's checks (each send one whole term, to a pid;
 * one reply per call, none otherwise): every term the process builds is
 * one a BEAM takes (ap_term_check), and the registry's invariants hold
 * after each message. Two things are not checked: what {send, Pid, Term}
 * passes on (bytes of the message itself: the peer's own term, one whole
 * term is all it must be), and the receiving node's own pids against that
 * node's limits (the receptionist keeps and lists the pids peers register
 * as they come: a pid of node A past A's 15-bit number, which A refuses,
 * reaches A's subscribers; a peer must make it up, no node does).
 */
#include <stdio.h>

#include "t_fuzz.h"

#define T_RCPT_CHECK(cond) t_check(cond)

#include "../receptionist/rcpt_proto.c"
#include "t_rcpt.h"

#define T_SMALL_LISTING 64u

static ap_term_strict t_strict;

/* What was sent since the last look, as the receiving BEAM decodes it,
 * but for copies of the message's own bytes (see the top). */
static void t_check_sent(const char *msg, size_t len)
{
	for (size_t k = 0; k < t_r.nout; k++) {
		const struct t_out *o = &t_r.out[k];
		int idx = 0;
		if (memmem(msg, len, o->term, (size_t)o->len))
			continue;
		if (ap_term_check(o->term, (size_t)o->len, &idx, &t_strict) || idx != o->len) {
			fprintf(stderr, "fuzz_rcpt_proto: a BEAM refuses what was sent: %s\n",
				t_strict.why ? t_strict.why : "(trailing bytes)");
			__builtin_trap();
		}
	}
	t_rcpt_clear();
}

static void t_check_registry(void)
{
	char why[256];
	if (registry_check(st.reg, why, sizeof why)) {
		fprintf(stderr, "fuzz_rcpt_proto: registry broken: %s\n", why);
		__builtin_trap();
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 1)
		return 0;
	t_rcpt_start(data[0] & 1 ? T_SMALL_LISTING : 0);
	size_t at = 1;
	char *msg = NULL;
	while (at + 2 <= size) {
		size_t len = (size_t)data[at] << 8 | data[at + 1];
		at += 2;
		if (len > size - at)
			len = size - at;
		/* Exact size: ASan sees a read past the message. */
		msg = realloc(msg, len + 1);
		T_RCPT_CHECK(msg != NULL);
		msg[0] = (char)131;
		memcpy(msg + 1, data + at, len);
		at += len;
		if (t_rcpt_deliver(msg, (int)len + 1) < 0)
			continue;
		t_check_sent(msg, len + 1);
		t_check_registry();
	}
	free(msg);
	return 0;
}
