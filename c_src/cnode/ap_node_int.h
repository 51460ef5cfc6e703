/* ap_node_int: ap_node's internals that its tests and fuzz targets reach;
 * no C node calls these. */
#ifndef AP_NODE_INT_H
#define AP_NODE_INT_H

#include "ap_node.h"

/* What a message is: m->buf[0..m->len) holds its encoding from the 131
 * byte (maybe only its start: the head of an oversized frame); m->kind is
 * AP_MSG_INFO on entry. A {'$gen_call', {Pid, Tag}, Req} becomes
 * AP_MSG_CALL with from, tag, tag_len and index (the request) set, a
 * {'$gen_cast', Req} AP_MSG_CAST with index set; anything else stays. Every
 * part is proved to lie inside m->len before ei reads it. */
void ap_node_classify(ap_msg *m);

#endif
