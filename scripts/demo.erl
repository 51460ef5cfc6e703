#!/usr/bin/env escript
%% -*- erlang -*-
%%
%% `make demo': starts the actor_pool application (which makes this node
%% distributed), starts the echo C node through actor_cnode, talks to it with
%% plain distributed Erlang, and stops everything. Exits 1 if any step does
%% not give the expected result.
-mode(compile).

main(_Args) ->
    Root = filename:dirname(filename:dirname(filename:absname(escript:script_name()))),
    Ebins = filelib:wildcard(filename:join([Root, "_build", "default", "lib", "*", "ebin"])),
    ok = code:add_pathsa(Ebins),
    try run() of
        ok ->
            io:format("~ndemo: all steps gave the expected result~n"),
            halt(0)
    catch
        Class:Reason:Stack ->
            io:format("~ndemo: FAILED ~p:~p~n~p~n", [Class, Reason, Stack]),
            cleanup(),
            halt(1)
    end.

run() ->
    {ok, _} = application:ensure_all_started(actor_pool),
    show("this BEAM node", node()),

    {ok, Owner} = actor_cnode:start(#{exe => "actor_echo_node"}),
    put(owner, Owner),
    Node = actor_cnode:node(Owner),
    show("actor_cnode:info(Owner)", actor_cnode:info(Owner)),

    expect("net_adm:ping(CNode)", pong, net_adm:ping(Node)),
    show("nodes(hidden)", nodes(hidden)),
    show("nodes()", nodes()),
    true = lists:member(Node, nodes(hidden)),

    Hello = {hello, self()},
    expect("gen_server:call({echo, CNode}, {hello, self()})", Hello,
           gen_server:call({echo, Node}, Hello)),
    expect("gen_server:call({echo, CNode}, ping)", pong,
           gen_server:call({echo, Node}, ping)),

    Ref = make_ref(),
    ok = gen_server:cast({echo, Node}, {reply_to, self(), {cast_came_back, Ref}}),
    Back = receive {cast_came_back, Ref} = M -> M after 5000 -> timeout end,
    expect("cast {reply_to, self(), Term}: Term came back",
           {cast_came_back, Ref}, Back),

    show("gen_server:call({echo, CNode}, stats)", gen_server:call({echo, Node}, stats)),

    ok = actor_cnode:stop(Owner),
    erase(owner),
    show("actor_cnode:stop(Owner)", ok),
    ok = application:stop(actor_pool),
    show("application:stop(actor_pool)", ok),
    _ = net_kernel:stop(),
    ok.

cleanup() ->
    case get(owner) of
        undefined -> ok;
        Owner -> catch actor_cnode:stop(Owner)
    end,
    _ = application:stop(actor_pool),
    _ = net_kernel:stop(),
    ok.

show(What, Value) ->
    io:format("~ts ~0tp~n", [string:pad(What, 58), Value]).

expect(What, Expected, Value) ->
    show(What, Value),
    case Value of
        Expected -> ok;
        _ -> error({unexpected, What, Value, expected, Expected})
    end.
