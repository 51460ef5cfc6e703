/* ap_setup: distribution handshakes through ei, on a helper thread, over
 * sockets we own (ei_socket_callbacks with EI_SCLBK_FLG_FULL_IMPL). A
 * finished handshake is handed to the loop as an AP_Q_CONN_UP item on the
 * node's sendq; ei keeps no record of the fd afterwards. Private. */
#ifndef AP_SETUP_H
#define AP_SETUP_H

#include <ei.h>

#include "ap_sendq.h"

enum { AP_Q_FRAME = 1, AP_Q_CONN_UP = 2, AP_Q_CONN_FAILED = 3, AP_Q_CALL = 4 };

typedef struct ap_setup_result {
	int fd;       /* AP_Q_CONN_UP: the connected socket, blocking */
	int tag;      /* what the caller passed to ap_setup_connect (0 for accepts) */
} ap_setup_result;

typedef struct ap_setup ap_setup;

/* ei_connect_xinit_ussi with our callbacks. Returns 0 or -1. */
int ap_ei_init(ei_cnode *ec, const char *node, const char *cookie, unsigned creation);
/* Listen on all interfaces, an ephemeral port, through ei (so ei_accept
 * can run on accepted fds). Returns the listen fd and sets *port, or -1. */
int ap_ei_listen(ei_cnode *ec, int *port);

ap_setup *ap_setup_start(ei_cnode *ec, ap_sendq *q, int handshake_ms);
void ap_setup_set_listener(ap_setup *s, int lfd);
void ap_setup_stop(ap_setup *s);
/* Hand over an accepted socket; the result arrives on q. */
void ap_setup_accept(ap_setup *s, int fd);
void ap_setup_connect(ap_setup *s, const char *node, int tag);

#endif
