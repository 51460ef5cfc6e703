%% A C node whose parent connects to it first (found by `make soak'): a
%% pool node restarted while processes of its BEAM keep sending to it by
%% name was reached by that BEAM before its own connection to the parent
%% got through; that connection then failed (the BEAM already had one), and
%% the node never reported ready, so its owner killed it at the start
%% timeout. Any connection to the parent must make the node ready.
%%
%% Made deterministic here: a standalone echo node is told to connect to a
%% parent that is not distributed yet (so its attempts fail and are retried
%% every 500 ms); the parent then starts distribution and connects to the C
%% node at once, well inside a retry interval.
-module(actor_cnode_parent_tests).

-import(ap_test_util, [alive/1, echo_exe/0, abs_exe/1]).
-import(ap_support, [wait_until/2, epmd_names/0, os_pid_alive/1]).

-include_lib("eunit/include/eunit.hrl").

-export([a_parent_that_connects_first_makes_the_node_ready/0, connect_as/3]).

-define(WAIT_MS, 20000).

actor_cnode_parent_test_() ->
    {setup, fun ap_test_util:start_app/0, fun ap_test_util:stop_app/1,
     [{"a_parent_that_connects_first_makes_the_node_ready",
       {timeout, 60, fun ?MODULE:a_parent_that_connects_first_makes_the_node_ready/0}}]}.

a_parent_that_connects_first_makes_the_node_ready() ->
    Dir = ap_test_util:temp_dir("actor_cnode_parent_tests"),
    CookieFile = filename:join(Dir, "cookie"),
    ok = file:write_file(CookieFile, atom_to_list(erlang:get_cookie())),
    ok = file:change_mode(CookieFile, 8#600),
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Alive = alive("parentfirst"),
    CNode = list_to_atom(Alive ++ "@" ++ Host),
    ParentAlive = Alive ++ "_parent",
    Parent = list_to_atom(ParentAlive ++ "@" ++ Host),
    %% The parent-to-be: a BEAM that is not distributed yet.
    {ok, P, nonode@nohost} = peer:start(#{connection => standard_io,
                           args => ["-pa", filename:dirname(code:which(?MODULE))]}),
    Port = open_port({spawn_executable, abs_exe(echo_exe())},
                     [{args, ["--name", atom_to_list(CNode), "--cookie-file", CookieFile,
                              "--connect", atom_to_list(Parent)]},
                      {line, 4096}, binary, exit_status, stderr_to_stdout, use_stdio]),
    {os_pid, OsPid} = erlang:port_info(Port, os_pid),
    try
        %% Its first attempts fail: the parent is not in epmd.
        _ = await_line(Port, "connect to " ++ atom_to_list(Parent) ++ " failed", ?WAIT_MS),
        true = peer:call(P, ?MODULE, connect_as, [Parent, erlang:get_cookie(), CNode]),
        %% Ready once the parent's connection is up, not at the next
        %% attempt of its own (which the parent would refuse: it has one).
        Ready = await_line(Port, " ready: port ", 5000),
        ?assertNotEqual(nomatch, string:find(Ready, atom_to_list(CNode))),
        ?assertEqual(pong, peer:call(P, net_adm, ping, [CNode]))
    after
        catch peer:stop(P),
        _ = os_pid_alive(OsPid) andalso os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        wait_until(fun() -> not os_pid_alive(OsPid) end, ?WAIT_MS),
        catch port_close(Port),
        _ = file:del_dir_r(Dir),
        wait_until(fun() -> [] =:= [N || N <- epmd_names(), N =:= Alive orelse N =:= ParentAlive] end,
                   ?WAIT_MS)
    end.

%% On the peer: start distribution as Name and connect to CNode at once.
-spec connect_as(node(), atom(), node()) -> boolean().
connect_as(Name, Cookie, CNode) ->
    {ok, _} = net_kernel:start(Name, #{name_domain => shortnames}),
    true = erlang:set_cookie(Cookie),
    net_kernel:connect_node(CNode).

%% The first line from Port that contains Pattern.
await_line(Port, Pattern, Timeout) ->
    Deadline = erlang:monotonic_time(millisecond) + Timeout,
    await_line(Port, Pattern, Timeout, Deadline).

await_line(Port, Pattern, Timeout, Deadline) ->
    receive
        {Port, {data, {_, Line}}} ->
            case string:find(Line, Pattern) of
                nomatch -> await_line(Port, Pattern, Timeout, Deadline);
                _ -> binary_to_list(Line)
            end;
        {Port, {exit_status, S}} ->
            error({exited, S})
    after max(0, Deadline - erlang:monotonic_time(millisecond)) ->
        error({no_line, Pattern, Timeout})
    end.

