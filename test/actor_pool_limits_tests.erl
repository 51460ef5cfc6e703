%% The pool options' upper limits the BEAM checks (src/actor_pool_int.hrl)
%% are the pool node's (c_src/pool/pool_limits.h, their source of truth).
-module(actor_pool_limits_tests).

-include_lib("eunit/include/eunit.hrl").

erlang_copy_equals_c_header_test() ->
    Root = ap_support:root(),
    C = limits(filename:join([Root, "c_src", "pool", "pool_limits.h"]),
               "#define[ \t]+(AP_POOL_MAX_[A-Z_]+)[ \t]+([0-9]+)"),
    Erl = limits(filename:join([Root, "src", "actor_pool_int.hrl"]),
                 "-define\\((AP_POOL_MAX_[A-Z_]+),[ \t]*([0-9]+)\\)"),
    ?assertNotEqual([], C),
    ?assertEqual(C, Erl).

limits(File, Re) ->
    {ok, Bin} = file:read_file(File),
    case re:run(Bin, Re, [global, multiline, {capture, all_but_first, list}]) of
        {match, Ms} -> lists:sort([{Name, list_to_integer(V)} || [Name, V] <- Ms]);
        nomatch -> []
    end.
