%% Definitions shared by the receptionist's modules (actor_receptionist*).
%% Internal: not part of the public API (include/actor_receptionist.hrl is).

-ifndef(ACTOR_RECEPTIONIST_INT_HRL).
-define(ACTOR_RECEPTIONIST_INT_HRL, true).

%% A key's id is a binary of 1..MAX_ID bytes: REGISTRY_MAX_KEY of the C
%% node's registry (c_src/receptionist/registry.h), so every way in refuses
%% a longer one before it reaches the C node.
-define(MAX_ID, 1024).

%% Guard test: Id is a valid key id.
-define(IS_ID(Id), (is_binary(Id) andalso byte_size(Id) >= 1 andalso byte_size(Id) =< ?MAX_ID)).

%% persistent_term key: {node(), ReceptionistNode} of the receptionist C node
%% that the application started on this node.
-define(RCPT_NODE_KEY, {actor_pool, receptionist_node}).

%% Registered names: the actor_cnode owner of the receptionist C node, the
%% BEAM-side receptionist server, and the registry process on the C node.
-define(RCPT_OWNER, actor_receptionist_owner).
-define(RCPT_SERVER, actor_receptionist_server).
-define(RCPT_PROC, actor_receptionist).

-endif.
