%% The Prometheus metrics (actor_pool_metrics) checked with the real tools:
%% `promtool check metrics' (Debian's prometheus package) on what render/0
%% and the endpoint return, and a real Prometheus server, started here on
%% loopback, that scrapes the application's endpoint: its query API must
%% return what actor_pool:stats/1 shows for a pool, and what the
%% receptionist holds. The Prometheus server is stopped by its OS pid; its
%% data directory is removed.
-module(actor_pool_metrics_tests).

-import(ap_support, [wait_until/2, os_pid_alive/1]).
-import(ap_test_util, [temp_dir/1]).

-include_lib("eunit/include/eunit.hrl").

-export([render_passes_promtool/1, endpoint_serves_metrics_and_nothing_else/1,
         counters_follow_the_pool/1, prometheus_scrapes_what_stats_shows/1]).

-define(WAIT_MS, 30000).

metrics_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{timeout, 60, {atom_to_list(T), fun() -> ?MODULE:T(Ctx) end}}
              || T <- [render_passes_promtool,
                       endpoint_serves_metrics_and_nothing_else,
                       counters_follow_the_pool,
                       prometheus_scrapes_what_stats_shows]]
     end}.

setup() ->
    WasAlive = is_alive(),
    ok = actor_dist:ensure_distributed(),
    Port = free_port(),
    application:load(actor_pool),
    ok = application:set_env(actor_pool, metrics_port, Port),
    {ok, _} = application:ensure_all_started(actor_pool),
    {ok, _} = application:ensure_all_started(inets),
    {ok, Pool} = actor_pool:start_pool(metrics_test_pool, echo, #{workers => 2}),
    #{was_alive => WasAlive, port => Port, pool => Pool}.

cleanup(#{was_alive := WasAlive, pool := Pool}) ->
    ok = actor_pool:stop_pool(Pool),
    ok = ap_test_util:stop_app(WasAlive),
    application:unset_env(actor_pool, metrics_port).

%% A port the OS had free a moment ago, for the endpoint and Prometheus.
free_port() ->
    {ok, S} = gen_tcp:listen(0, [{ip, {127, 0, 0, 1}}]),
    {ok, Port} = inet:port(S),
    ok = gen_tcp:close(S),
    Port.

%% ===================================================================
%% Cases
%% ===================================================================

render_passes_promtool(#{pool := Pool}) ->
    {ok, _} = actor_pool:ask(Pool, <<"x">>),
    Text = iolist_to_binary(actor_pool_metrics:render()),
    ?assertEqual({0, ""}, ap_test_util:promtool_check(Text)),
    %% Every family the docs promise is there.
    [?assertMatch({match, _}, re:run(Text, "^# TYPE " ++ F ++ " ", [multiline]), F)
     || F <- ["actor_pool_processed_total", "actor_pool_errors_total",
              "actor_pool_crashes_total", "actor_pool_restarts_total",
              "actor_pool_overloaded_total", "actor_pool_dropped_tells_total",
              "actor_pool_bad_replies_total", "actor_pool_stalls_total",
              "actor_pool_handler_duration_seconds", "actor_pool_ask_duration_seconds",
              "actor_pool_ran_on_loop_total", "actor_pool_messages_total", "actor_pool_worker_mailbox_depth",
              "actor_pool_worker_processed_total", "actor_pool_batcher_queued",
              "actor_receptionist_keys", "actor_receptionist_refs",
              "actor_receptionist_subscribers", "actor_receptionist_members",
              "actor_receptionist_view_complete", "actor_receptionist_gossip_messages_total",
              "actor_receptionist_gossip_bytes_total", "actor_receptionist_full_syncs_total",
              "actor_receptionist_member_drops_total", "actor_receptionist_gossip_rejected_total",
              "actor_pool_cnode_up",
              "actor_pool_cnode_restarts_total", "actor_pool_cnode_resident_memory_bytes",
              "actor_pool_cnode_uptime_seconds"]].

endpoint_serves_metrics_and_nothing_else(#{port := Port}) ->
    ?assertEqual({ok, Port}, actor_pool_metrics:port()),
    Base = "http://127.0.0.1:" ++ integer_to_list(Port),
    {ok, {{_, 200, _}, Headers, Body}} = httpc:request(get, {Base ++ "/metrics", []}, [],
                                                       [{body_format, binary}]),
    ?assertEqual("text/plain; version=0.0.4; charset=utf-8",
                 proplists:get_value("content-type", Headers)),
    ?assertEqual({0, ""}, ap_test_util:promtool_check(Body)),
    ?assertMatch({ok, {{_, 404, _}, _, _}}, httpc:request(Base ++ "/")),
    ?assertMatch({ok, {{_, 405, _}, _, _}},
                 httpc:request(post, {Base ++ "/metrics", [], "text/plain", "x"}, [], [])),
    %% Loopback only, by default: not on the host's other addresses.
    case other_address() of
        none -> ok;
        Ip -> ?assertMatch({error, _}, gen_tcp:connect(Ip, Port, [], 2000))
    end.

counters_follow_the_pool(#{pool := Pool}) ->
    Before = sample(<<"actor_pool_processed_total">>, pool_labels(Pool)),
    [ok = actor_pool:tell(Pool, <<"t">>) || _ <- lists:seq(1, 500)],
    {ok, _} = actor_pool:ask(Pool, <<"a">>),
    wait_until(fun() -> maps:get(processed, actor_pool:stats(Pool)) >= Before + 501 end, ?WAIT_MS),
    #{processed := P, workers := Ws} = actor_pool:stats(Pool),
    ?assertEqual(P, sample(<<"actor_pool_processed_total">>, pool_labels(Pool))),
    ?assertEqual(lists:sum([maps:get(processed, W) || W <- Ws]),
                 lists:sum([sample(<<"actor_pool_worker_processed_total">>,
                                   pool_labels(Pool) ++ [{"worker", integer_to_list(maps:get(id, W))}])
                            || W <- Ws])),
    Key = actor_receptionist:service_key(<<"metrics.key">>),
    ok = actor_receptionist:register(Key, self(), self()),
    receive {registered, Key, _} -> ok after ?WAIT_MS -> error(not_registered) end,
    ?assert(sample(<<"actor_receptionist_refs">>, [{"origin", "local"}]) >= 1),
    ok = actor_receptionist:deregister(Key, self(), self()),
    receive {deregistered, Key, _} -> ok after ?WAIT_MS -> error(not_deregistered) end.

prometheus_scrapes_what_stats_shows(#{port := Port, pool := Pool}) ->
    case os:find_executable("prometheus") of
        false -> error(prometheus_not_installed_run_scripts_install_deps);
        Exe -> with_prometheus(Exe, Port, fun(PromPort) -> scraped(PromPort, Pool) end)
    end.

scraped(PromPort, Pool) ->
    [ok = actor_pool:tell(Pool, <<"t">>) || _ <- lists:seq(1, 1000)],
    Query = "actor_pool_processed_total{pool=\"metrics_test_pool\"}",
    %% The pool is quiet now: the next scrapes must agree with stats/1.
    wait_until(fun() ->
                       #{processed := P} = actor_pool:stats(Pool),
                       P > 0 andalso query(PromPort, Query) =:= {ok, P}
               end, ?WAIT_MS),
    wait_until(fun() ->
                       query(PromPort, "actor_pool_cnode_up{role=\"pool\"}") =:= {ok, 1}
               end, ?WAIT_MS).

%% ===================================================================
%% Helpers
%% ===================================================================

pool_labels(Pool) ->
    [{"pool", "metrics_test_pool"}, {"node", atom_to_list(node(Pool))}].

%% The value of the sample Name{Labels} (labels in the order rendered).
sample(Name, Labels) ->
    Text = iolist_to_binary(actor_pool_metrics:render()),
    L = iolist_to_binary([Name, "{", lists:join(",", [[K, "=\"", V, "\""] || {K, V} <- Labels]), "}"]),
    [Line] = [X || X <- binary:split(Text, <<"\n">>, [global]),
                   binary:longest_common_prefix([X, <<L/binary, " ">>]) =:= byte_size(L) + 1],
    [_, V] = binary:split(Line, <<" ">>),
    binary_to_integer(V).


%% A non-loopback IPv4 address of this host, or none.
other_address() ->
    {ok, Ifs} = inet:getifaddrs(),
    case [A || {_, Opts} <- Ifs, {addr, {I, _, _, _} = A} <- Opts, I =/= 127] of
        [A | _] -> A;
        [] -> none
    end.

%% Runs Fun(PromPort) with a Prometheus server that scrapes 127.0.0.1:Port
%% every second; stops it (by OS pid) and removes its data afterwards.
with_prometheus(Exe, Port, Fun) ->
    Dir = temp_dir("ap_prometheus"),
    Cfg = filename:join(Dir, "prometheus.yml"),
    ok = file:write_file(Cfg, io_lib:format(
                                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                                "scrape_configs:\n  - job_name: actor_pool\n"
                                "    static_configs:\n      - targets: ['127.0.0.1:~b']\n",
                                [Port])),
    PromPort = free_port(),
    P = open_port({spawn_executable, Exe},
                  [{args, ["--config.file=" ++ Cfg,
                           "--storage.tsdb.path=" ++ filename:join(Dir, "data"),
                           "--web.listen-address=127.0.0.1:" ++ integer_to_list(PromPort),
                           "--log.level=warn"]},
                   exit_status, stderr_to_stdout, binary, {cd, Dir}]),
    {os_pid, OsPid} = erlang:port_info(P, os_pid),
    try
        wait_until(fun() -> query(PromPort, "up") =/= error end, ?WAIT_MS),
        Fun(PromPort)
    after
        os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        wait_until(fun() -> not os_pid_alive(OsPid) end, ?WAIT_MS),
        catch port_close(P),
        os:cmd("rm -rf '" ++ Dir ++ "'")
    end.

%% The value of an instant query's single sample: {ok, Int} | none | error.
query(PromPort, Q) ->
    Url = "http://127.0.0.1:" ++ integer_to_list(PromPort) ++ "/api/v1/query?query="
        ++ uri_string:quote(Q),
    case httpc:request(get, {Url, []}, [{timeout, 2000}], [{body_format, binary}]) of
        {ok, {{_, 200, _}, _, Body}} ->
            case re:run(Body, "\"value\":\\[[0-9.]+,\"([0-9.e+-]+)\"\\]",
                        [{capture, all_but_first, list}]) of
                {match, [V]} ->
                    case string:to_integer(V) of
                        {I, ""} -> {ok, I};
                        _ -> {ok, list_to_float(V)}
                    end;
                nomatch -> none
            end;
        _ ->
            error
    end.
