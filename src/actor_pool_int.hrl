%% Names shared by actor_pool, actor_pool_sup, actor_pool_batch_sup and
%% actor_pool_batcher. Internal: not part of the public API.

%% persistent_term key: {node(), LocalPoolNode} of the pool C node that the
%% application started on this node (written by actor_pool_sup when the
%% owner is up, erased by actor_pool_app:stop/1).
-define(POOL_NODE_KEY, {actor_pool, pool_node}).

%% Registered name of the actor_cnode owner of the local pool C node.
-define(POOL_NODE_OWNER, actor_pool_node_owner).

%% Registered name of the manager process on every pool C node.
-define(MANAGER, actor_pool_node).

%% ETS table (public, read_concurrency) of batcher groups, one row per pool
%% node: {Node, Atomics, {Batcher1, ..., BatcherN}, IdleUs}.
-define(BATCH_TAB, actor_pool_batchers).
