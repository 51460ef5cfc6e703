%% The pool options' upper limits the BEAM checks (src/actor_pool_int.hrl)
%% are the pool node's (c_src/pool/pool_limits.h, their source of truth).
%% The limits of the pool node's own flags (--ring-poll-us and the like:
%% no pool option, no application key) are checked by it alone.
-module(actor_pool_limits_tests).

-include_lib("eunit/include/eunit.hrl").

erlang_copy_equals_c_header_test() ->
    Root = ap_support:root(),
    C0 = limits(filename:join([Root, "c_src", "pool", "pool_limits.h"]),
                "#define[ \t]+(AP_POOL_MAX_[A-Z_]+)[ \t]+([0-9]+)"),
    C = [L || {Name, _} = L <- C0, not lists:member(Name, node_only())],
    Erl = limits(filename:join([Root, "src", "actor_pool_int.hrl"]),
                 "-define\\((AP_POOL_MAX_[A-Z_]+),[ \t]*([0-9]+)\\)"),
    ?assertNotEqual([], C),
    ?assertEqual(C, Erl).

node_only() ->
    ["AP_POOL_MAX_RING_NAP_US", "AP_POOL_MAX_RING_POLL_US"].

limits(File, Re) ->
    {ok, Bin} = file:read_file(File),
    case re:run(Bin, Re, [global, multiline, {capture, all_but_first, list}]) of
        {match, Ms} -> lists:sort([{Name, list_to_integer(V)} || [Name, V] <- Ms]);
        nomatch -> []
    end.
