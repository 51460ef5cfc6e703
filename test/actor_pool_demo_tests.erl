%% `make demo' (scripts/demo.erl), run as the user runs it but with --short:
%% it must succeed, print the key lines of its transcript, and leave no
%% node behind in epmd.
-module(actor_pool_demo_tests).

-include_lib("eunit/include/eunit.hrl").

demo_test_() ->
    {timeout, 180, fun demo_transcript/0}.

demo_transcript() ->
    {ok, Cwd} = file:get_cwd(),
    Script = filename:join([Cwd, "scripts", "demo.erl"]),
    ?assert(filelib:is_regular(Script)),
    Port = open_port({spawn_executable, os:find_executable("escript")},
                     [{args, [Script, "--short"]}, {cd, Cwd}, exit_status, binary,
                      stderr_to_stdout, {line, 4096}]),
    {Status, Lines} = collect(Port, [], erlang:monotonic_time(millisecond) + 170000),
    Text = lists:flatten(lists:join("\n", Lines)),
    Has = fun(Pattern) ->
                  case re:run(Text, Pattern, [unicode]) of
                      {match, _} -> true;
                      nomatch -> io:format(user, "~ndemo transcript lacks ~s:~n~s~n", [Pattern, Text]),
                                 false
                  end
          end,
    Lacks = fun(Pattern) ->
                    case re:run(Text, Pattern, [unicode]) of
                        nomatch -> true;
                        {match, _} -> io:format(user, "~ndemo transcript has ~s:~n~s~n", [Pattern, Text]),
                                      false
                    end
            end,
    ?assertEqual(0, Status),
    ?assert(Has("demo: all steps gave the expected result")),
    ?assert(Has("answers that disagree with the generator +0")),
    ?assert(Has("peer started +demo_b_")),
    ?assert(Has("listing for \"json-validator\" +\\{pools,1,\\[demo_pool_")),
    ?assert(Has("== the pool node is killed[^=]*listing for \"json-validator\" +\\{pools,0,\\[\\]\\}")),
    ?assert(Has("actor_pool:ask\\(Key, Doc\\) +\\{error,no_pool\\}")),
    ?assert(Has("== the pool node runs again[\\s\\S]*\\{pools,1,\\[demo_pool_")),
    ?assert(Has("the cluster stopped \\(peers, pool node\\) +ok")),
    ?assert(Has("actor_pool:stop_pool\\(demo_json\\) again +\\{error,noproc\\}")),
    %% The demo sends nothing to a name the pool node no longer has (that
    %% would log a warning there when it goes by distribution).
    ?assert(Lacks("unregistered name")),
    %% Nor does global (OTP 25+) drop a connection while the demo stops its
    %% peers: it stops them together (stop_peers/1 in scripts/demo.erl).
    ?assert(Lacks("overlapping partitions")),
    %% No other warning or error report from any node either: the
    %% transcript is what a newcomer reads first.
    ?assert(Lacks("=(WARNING|ERROR|CRASH) REPORT")),
    %% Nothing of the demo's left in epmd.
    ?assertEqual([], [N || N <- ap_support:epmd_names(), lists:prefix("demo_", N)]).

collect(Port, Acc, Deadline) ->
    Left = max(0, Deadline - erlang:monotonic_time(millisecond)),
    receive
        {Port, {data, {eol, L}}} -> collect(Port, [binary_to_list(L) | Acc], Deadline);
        {Port, {data, {noeol, L}}} -> collect(Port, [binary_to_list(L) | Acc], Deadline);
        {Port, {exit_status, S}} -> {S, lists:reverse(Acc)}
    after Left ->
        {os_pid, OsPid} = erlang:port_info(Port, os_pid),
        _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        error({demo_timeout, lists:reverse(Acc)})
    end.
