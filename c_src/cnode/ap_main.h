/* ap_main: the shared main() of every C node: settings from the owning
 * port (--port) or the command line, then the service's own start. */
#ifndef AP_MAIN_H
#define AP_MAIN_H

#include "ap_node.h"

/* Called once the node exists, before it serves: spawn the service's
 * processes. args are the service-specific arguments (port `args`, or what
 * follows `--` on the command line). Return 0, or non-zero to exit. */
typedef int (*ap_service_init)(ap_node *n, int argc, char **argv);

int ap_cnode_main(int argc, char **argv, const char *service, ap_service_init init);

#endif
