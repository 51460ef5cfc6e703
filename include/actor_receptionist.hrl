%% Records for the messages of actor_receptionist, for those who prefer
%% records to tuples: each record is exactly the tuple that arrives, e.g.
%% #listing{key = Key, refs = Refs} is {listing, Key, Refs}.
%%
%%   -include_lib("actor_pool/include/actor_receptionist.hrl").

-ifndef(ACTOR_RECEPTIONIST_HRL).
-define(ACTOR_RECEPTIONIST_HRL, true).

%% A service key: what actor_receptionist:service_key/1 returns.
-record(service_key, {id :: binary()}).

%% find/2 answers with one; subscribe/2 sends one now and one per change.
-record(listing, {key :: #service_key{}, refs :: [pid()]}).

%% register/3 and deregister/3 acknowledge with these.
-record(registered, {key :: #service_key{}, ref :: pid()}).
-record(deregistered, {key :: #service_key{}, ref :: pid()}).

%% A subscribe over a limit gets this instead of its first listing, and no
%% listing after it.
-record(receptionist_subscribe_rejected,
        {key :: #service_key{},
         reason :: max_subscribers_per_key | max_subscribers_total,
         limit :: non_neg_integer()}).

-endif.
